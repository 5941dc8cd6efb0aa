// Atomically exchange two paths (renameat2 RENAME_EXCHANGE): the cache swap of
// tools/build-kube-apiserver-current.sh.
package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: exchange PATH1 PATH2")
		os.Exit(2)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, os.Args[1], unix.AT_FDCWD, os.Args[2], unix.RENAME_EXCHANGE); err != nil {
		fmt.Fprintf(os.Stderr, "exchange %s %s: %v\n", os.Args[1], os.Args[2], err)
		os.Exit(1)
	}
}
