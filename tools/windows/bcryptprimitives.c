/* Stand-in for Windows' bcryptprimitives.dll under Wine 8, which lacks ProcessPrng (the random
 * source Rust's standard library imports since Windows 10). It fills the buffer from
 * RtlGenRandom (advapi32's SystemFunction036). Built by tools/windows.sh into the test Wine
 * prefix only; it never ships. */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length)
{
    while (length > 0) {
        ULONG chunk = length > 0x40000000 ? 0x40000000 : (ULONG)length;
        if (!SystemFunction036(data, chunk))
            return FALSE;
        data += chunk;
        length -= chunk;
    }
    return TRUE;
}
