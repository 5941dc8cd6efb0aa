//! Output codecs: gzip'd JSON maps of base64 values (`applied-output`, `failed-output`,
//! `applied-periodic-output`) and Go's `time.UnixDate` timestamps.

use super::PeriodicInstructionOutput;
use base64::Engine as _;
use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use std::collections::BTreeMap;
use std::io::{Read, Write};

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("not gzip data: {0}")]
    Gzip(std::io::Error),
    #[error("bad JSON inside the gzip data: {0}")]
    Json(serde_json::Error),
    #[error("bad base64 value for {0:?}: {1}")]
    Base64(String, base64::DecodeError),
    #[error(
        "the gzip data decompresses to more than {} MiB, far beyond what the output caps allow; refused",
        MAX_DECOMPRESSED >> 20
    )]
    TooLarge,
}

/// What outputs read back (from the Secret, or a `.pos` file) may decompress to. Outputs are
/// capped when they are made (`outputCap` per instruction, a 256 KiB gzip budget per Secret
/// key), so this only stops a crafted gzip (1 MiB can expand to 1 GiB) from exhausting memory.
pub const MAX_DECOMPRESSED: u64 = 64 << 20;

fn gzip(json: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(json);
    enc.finish().unwrap_or_default()
}

fn gunzip(data: &[u8]) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    GzDecoder::new(data).take(MAX_DECOMPRESSED + 1).read_to_end(&mut out).map_err(CodecError::Gzip)?;
    if out.len() as u64 > MAX_DECOMPRESSED {
        return Err(CodecError::TooLarge);
    }
    Ok(out)
}

/// gzip(JSON map name → base64(bytes)), the encoding of `applied-output` and `failed-output`.
pub fn encode_one_time_output(map: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let m: BTreeMap<&str, String> = map.iter().map(|(k, v)| (k.as_str(), b64.encode(v))).collect();
    gzip(&serde_json::to_vec(&m).unwrap_or_default())
}

/// Inverse of [`encode_one_time_output`]; empty input is an empty map.
pub fn decode_one_time_output(data: &[u8]) -> Result<BTreeMap<String, Vec<u8>>, CodecError> {
    if data.is_empty() {
        return Ok(BTreeMap::new());
    }
    let json = gunzip(data)?;
    let m: BTreeMap<String, Option<String>> = serde_json::from_slice(&json).map_err(CodecError::Json)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    m.into_iter()
        .map(|(k, v)| {
            let bytes = b64.decode(v.unwrap_or_default().as_bytes()).map_err(|e| CodecError::Base64(k.clone(), e))?;
            Ok((k, bytes))
        })
        .collect()
}

/// gzip(JSON map name → PeriodicInstructionOutput), the encoding of `applied-periodic-output`.
pub fn encode_periodic_output(map: &BTreeMap<String, PeriodicInstructionOutput>) -> Vec<u8> {
    gzip(&serde_json::to_vec(map).unwrap_or_default())
}

pub fn decode_periodic_output(data: &[u8]) -> Result<BTreeMap<String, PeriodicInstructionOutput>, CodecError> {
    if data.is_empty() {
        return Ok(BTreeMap::new());
    }
    serde_json::from_slice(&gunzip(data)?).map_err(CodecError::Json)
}

/// Go `time.UnixDate` (`Mon Jan _2 15:04:05 MST 2006`), always in UTC.
pub fn format_unix_date(t: DateTime<Utc>) -> String {
    t.format("%a %b %e %H:%M:%S UTC %Y").to_string()
}

/// A time as every command shows it, RFC 3339 to the second (`2026-12-02T12:00:00Z`), from either
/// form an agent writes: Go's `UnixDate` (a plan Secret's `last-apply-time` and a `.pos` file's, as
/// system-agent writes them) or a NodePlan's RFC 3339 with milliseconds. Anything else is kept as
/// written (empty stays empty).
pub fn shown_time(t: &str) -> String {
    let parsed = parse_unix_date(t).or_else(|| DateTime::parse_from_rfc3339(t).ok().map(|d| d.with_timezone(&Utc)));
    match parsed {
        Some(d) => d.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        None => t.to_string(),
    }
}

/// Parse a Go `time.UnixDate` string. The zone abbreviation is read as UTC, as Go does for a
/// zone it does not know on a UTC host. `None` when unparsable.
pub fn parse_unix_date(s: &str) -> Option<DateTime<Utc>> {
    let parts: Vec<&str> = s.split_whitespace().collect();
    // weekday month day time zone year
    let [_, month, day, time, _zone, year] = parts.as_slice() else {
        return None;
    };
    let normal = format!("{month} {day} {time} {year}");
    let naive = NaiveDateTime::parse_from_str(&normal, "%b %d %H:%M:%S %Y").ok()?;
    Some(Utc.from_utc_datetime(&naive))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 65 MiB of JSON whitespace gzips to ~64 KiB: read back, it is refused, not inflated.
    #[test]
    fn times_are_shown_in_rfc3339_whatever_the_agent_wrote() {
        assert_eq!(shown_time("Wed Dec  2 12:00:00 UTC 2026"), "2026-12-02T12:00:00Z");
        assert_eq!(shown_time("2026-12-02T12:00:00.123Z"), "2026-12-02T12:00:00Z");
        assert_eq!(shown_time(""), "");
        assert_eq!(shown_time("soon"), "soon");
    }

    #[test]
    fn a_gzip_bomb_read_back_is_refused() {
        let mut json = vec![b' '; (MAX_DECOMPRESSED + (1 << 20)) as usize];
        json.extend_from_slice(b"{}");
        let data = gzip(&json);
        assert!(matches!(decode_one_time_output(&data), Err(CodecError::TooLarge)));
        assert!(matches!(decode_periodic_output(&data), Err(CodecError::TooLarge)));
        let e = decode_one_time_output(&data).unwrap_err().to_string();
        assert!(e.contains("64 MiB") && !e.contains('\n'), "{e}");
        let small = gzip(b"{}");
        assert!(decode_one_time_output(&small).unwrap().is_empty());
    }
}
