//! AWS Signature Version 4 (header-based), pure and I/O-free: the canonical request, the string
//! to sign, the derived signing key and the `Authorization` header, for the requests of an
//! `s3://` store (GET with `Range`, HEAD, PUT, the multipart calls). Time and credentials come in
//! as arguments, so every function is checked against AWS's published examples in the tests.
//!
//! Why not a crate: `rusty-s3` signs only presigned URLs (the signature and the session token go
//! into the query string, so into every URL that an error message or a log line names), and
//! `aws-sigv4` pulls in tokio and the aws-smithy runtime (about 30 crates) and needs a newer
//! Rust than the workspace's. Header signing is HMAC-SHA256 over a documented text; `hmac`
//! and `sha2` (RustCrypto) do the cryptography.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The hex sha256 of an empty payload (a GET, a HEAD, a DELETE).
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// An access key pair, with the session token of temporary credentials. `Debug` never shows the
/// secret or the token.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// `AWS_ACCESS_KEY_ID` (not a secret: it appears in every `Authorization` header).
    pub access_key_id: String,
    /// `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: String,
    /// `AWS_SESSION_TOKEN`, sent as `x-amz-security-token`.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("session_token", &self.session_token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// A request to sign. `path` is already URI-encoded (as sent); `query` holds raw (unencoded)
/// pairs; `headers` every header to sign besides `host` (names in any case).
#[derive(Debug, Clone)]
pub struct SignRequest<'a> {
    pub method: &'a str,
    pub host: &'a str,
    pub path: &'a str,
    pub query: &'a [(&'a str, &'a str)],
    pub headers: &'a [(&'a str, &'a str)],
    /// Hex sha256 of the body, or `UNSIGNED-PAYLOAD`.
    pub payload_sha256: &'a str,
}

/// Percent-encode `s` as SigV4 wants: every byte but `A-Za-z0-9-._~` (and `/` when
/// `keep_slash`, for paths) as `%XX` with upper-case hex.
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `YYYYMMDDTHHMMSSZ` for `unix` seconds (UTC).
pub fn amz_date(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    // HMAC takes a key of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(data.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The canonical request and the signed-headers list of `req`.
pub fn canonical_request(req: &SignRequest<'_>) -> (String, String) {
    let mut query: Vec<(String, String)> =
        req.query.iter().map(|(k, v)| (uri_encode(k, false), uri_encode(v, false))).collect();
    query.sort();
    let query = query.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    let mut headers: Vec<(String, String)> = std::iter::once(("host".to_owned(), req.host.trim().to_owned()))
        .chain(
            req.headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.split_whitespace().collect::<Vec<_>>().join(" "))),
        )
        .collect();
    headers.sort();
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let signed = headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(";");
    let path = if req.path.is_empty() { "/" } else { req.path };
    let text =
        format!("{}\n{path}\n{query}\n{canonical_headers}\n{signed}\n{}", req.method, req.payload_sha256);
    (text, signed)
}

/// The `Authorization` header value for `req`, signed at `amz_date` (`YYYYMMDDTHHMMSSZ`, also
/// sent as `x-amz-date`, which `req.headers` must hold) for `region` and `service`.
pub fn authorization(
    req: &SignRequest<'_>,
    creds: &Credentials,
    region: &str,
    service: &str,
    amz_date: &str,
) -> String {
    let (canonical, signed) = canonical_request(req);
    let date = amz_date.get(..8).unwrap_or(amz_date);
    let scope = format!("{date}/{region}/{service}/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let k_date = hmac(format!("AWS4{}", creds.secret_access_key).as_bytes(), date);
    let k_region = hmac(&k_date, region);
    let k_service = hmac(&k_region, service);
    let k_signing = hmac(&k_service, "aws4_request");
    let signature = hex::encode(hmac(&k_signing, &to_sign));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
        creds.access_key_id
    )
}

/// The headers that authorize the S3 request `req` at `unix` seconds: `x-amz-date`,
/// `x-amz-content-sha256`, `x-amz-security-token` (with a session token) and `authorization`.
/// `req.headers` are the request's own headers that are signed too (`range`, `content-type`,
/// `if-none-match`, …).
pub fn s3_headers(
    req: &SignRequest<'_>,
    creds: &Credentials,
    region: &str,
    unix: u64,
) -> Vec<(String, String)> {
    let date = amz_date(unix);
    let mut out: Vec<(String, String)> = vec![
        ("x-amz-date".into(), date.clone()),
        ("x-amz-content-sha256".into(), req.payload_sha256.to_owned()),
    ];
    if let Some(token) = &creds.session_token {
        out.push(("x-amz-security-token".into(), token.clone()));
    }
    let mut signed: Vec<(&str, &str)> = req.headers.to_vec();
    signed.extend(out.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let full = SignRequest { headers: &signed, ..req.clone() };
    let auth = authorization(&full, creds, region, "s3", &date);
    out.push(("authorization".into(), auth));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example key pair of AWS's S3 signing examples.
    fn example() -> Credentials {
        Credentials {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        }
    }

    fn sha(b: &[u8]) -> String {
        hex::encode(Sha256::digest(b))
    }

    /// 2013-05-24T00:00:00Z, the time of the S3 examples.
    const MAY_24_2013: u64 = 1_369_353_600;

    #[allow(clippy::too_many_arguments)]
    fn s3(
        c: &Credentials,
        method: &str,
        host: &str,
        path: &str,
        query: &[(&str, &str)],
        headers: &[(&str, &str)],
        payload_sha256: &str,
        region: &str,
    ) -> Vec<(String, String)> {
        let req = SignRequest { method, host, path, query, headers, payload_sha256 };
        s3_headers(&req, c, region, MAY_24_2013)
    }

    fn signature(auth: &str) -> &str {
        auth.rsplit_once("Signature=").map_or("", |(_, s)| s)
    }

    #[test]
    fn dates() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(MAY_24_2013), "20130524T000000Z");
        assert_eq!(amz_date(1_440_938_160), "20150830T123600Z");
        assert_eq!(amz_date(951_782_400), "20000229T000000Z", "a leap day");
        assert_eq!(amz_date(4_102_444_799), "20991231T235959Z");
    }

    #[test]
    fn encoding() {
        assert_eq!(uri_encode("a b/c$~", true), "a%20b/c%24~");
        assert_eq!(uri_encode("a/b=c", false), "a%2Fb%3Dc");
        assert_eq!(EMPTY_SHA256, sha(b""));
    }

    /// The S3 documentation's header-signing examples (GET Object with Range, PUT Object, GET
    /// Bucket lifecycle, GET Bucket with a query): values of AWS's published vectors.
    #[test]
    fn aws_s3_examples() {
        let c = example();
        let host = "examplebucket.s3.amazonaws.com";
        let get = s3(&c, "GET", host, "/test.txt", &[], &[("Range", "bytes=0-9")], EMPTY_SHA256, "us-east-1");
        let auth = &get.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        assert!(!get.iter().any(|(k, _)| k == "x-amz-security-token"));

        let body = sha(b"Welcome to Amazon S3.");
        let put = s3(
            &c,
            "PUT",
            host,
            &uri_encode("/test$file.text", true),
            &[],
            &[("Date", "Fri, 24 May 2013 00:00:00 GMT"), ("x-amz-storage-class", "REDUCED_REDUNDANCY")],
            &body,
            "us-east-1",
        );
        let auth = &put.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert!(auth.contains("SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class"));
        assert_eq!(signature(auth), "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");

        let lifecycle = s3(&c, "GET", host, "/", &[("lifecycle", "")], &[], EMPTY_SHA256, "us-east-1");
        let auth = &lifecycle.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert_eq!(signature(auth), "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");

        let list =
            s3(&c, "GET", host, "/", &[("prefix", "J"), ("max-keys", "2")], &[], EMPTY_SHA256, "us-east-1");
        let auth = &list.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert_eq!(signature(auth), "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
    }

    /// The generic SigV4 suite's `get-vanilla` (service `service`, no content hash header).
    #[test]
    fn aws_sigv4_suite_get_vanilla() {
        let c = Credentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        };
        let date = "20150830T123600Z";
        let req = SignRequest {
            method: "GET",
            host: "example.amazonaws.com",
            path: "/",
            query: &[],
            headers: &[("X-Amz-Date", date)],
            payload_sha256: EMPTY_SHA256,
        };
        assert_eq!(
            authorization(&req, &c, "us-east-1", "service", date),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
    }

    #[test]
    fn session_token_is_sent_and_signed_and_secrets_stay_out_of_debug() {
        let c = Credentials { session_token: Some("TOKEN-SECRET".into()), ..example() };
        let h = s3(&c, "HEAD", "h:9000", "/b/k", &[], &[], EMPTY_SHA256, "eu-west-1");
        assert_eq!(h.iter().find(|(k, _)| k == "x-amz-security-token").unwrap().1, "TOKEN-SECRET");
        let auth = &h.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert!(auth.contains("SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token"));
        assert!(auth.contains("/eu-west-1/s3/aws4_request"));
        assert!(!auth.contains("EXAMPLEKEY") && !auth.contains("TOKEN-SECRET"));
        let debug = format!("{c:?}");
        assert!(!debug.contains("EXAMPLEKEY") && !debug.contains("TOKEN-SECRET"), "{debug}");
        // Another token, another signature.
        let other = Credentials { session_token: Some("OTHER".into()), ..example() };
        let h2 = s3(&other, "HEAD", "h:9000", "/b/k", &[], &[], EMPTY_SHA256, "eu-west-1");
        assert_ne!(signature(auth), signature(&h2.iter().find(|(k, _)| k == "authorization").unwrap().1));
    }

    #[test]
    fn multipart_queries_are_canonical() {
        // CreateMultipartUpload `?uploads`, UploadPart `?partNumber=N&uploadId=ID` (sorted, encoded).
        let (text, _) = canonical_request(&SignRequest {
            method: "POST",
            host: "h",
            path: "/b/k",
            query: &[("uploads", "")],
            headers: &[],
            payload_sha256: EMPTY_SHA256,
        });
        assert_eq!(text.lines().nth(2), Some("uploads="));
        let (text, _) = canonical_request(&SignRequest {
            method: "PUT",
            host: "h",
            path: "/b/k",
            query: &[("uploadId", "a+b/c="), ("partNumber", "2")],
            headers: &[],
            payload_sha256: EMPTY_SHA256,
        });
        assert_eq!(text.lines().nth(2), Some("partNumber=2&uploadId=a%2Bb%2Fc%3D"));
    }
}
