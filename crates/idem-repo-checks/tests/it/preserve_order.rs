//! With serde_json's `preserve_order` on, a `Map` keeps insertion order: canonical JSON must
//! still sort the keys, or a redelivery with reordered keys fingerprints differently and is taken
//! for a conflict.

use idem_core::fingerprint::canonical_json;
use idem_core::{Fingerprint, FingerprintSpec};

fn fp(json: &str) -> Fingerprint {
    Fingerprint::of_json_bytes(json.as_bytes()).expect("test JSON")
}

/// Refuses to pass vacuously: the build must really keep insertion order.
#[test]
fn this_build_preserves_insertion_order() {
    let v: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":2}"#).expect("test JSON");
    let keys: Vec<_> = v.as_object().expect("object").keys().collect();
    assert_eq!(keys, ["b", "a"], "serde_json/preserve_order is not on in this build");
}

#[test]
fn reordered_keys_fingerprint_the_same() {
    assert_eq!(fp(r#"{"a":1,"b":2}"#), fp(r#"{"b":2,"a":1}"#));
    assert_eq!(
        canonical_json(&serde_json::from_str(r#"{"b":2,"a":1}"#).expect("JSON")),
        r#"{"a":1,"b":2}"#
    );
}

#[test]
fn reordered_nested_keys_fingerprint_the_same() {
    let a = r#"{"order":{"id":7,"lines":[{"sku":"x","qty":1}]},"at":"t"}"#;
    let b = r#"{"at":"t","order":{"lines":[{"qty":1,"sku":"x"}],"id":7}}"#;
    assert_eq!(fp(a), fp(b));
    let spec = FingerprintSpec::CanonicalJson;
    assert_eq!(spec.fingerprint(a.as_bytes()).ok(), spec.fingerprint(b.as_bytes()).ok());
    let ptrs = ["/order"];
    let (va, vb): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(a).expect("JSON"), serde_json::from_str(b).expect("JSON"));
    assert_eq!(
        Fingerprint::of_json_pointers(&va, &ptrs),
        Fingerprint::of_json_pointers(&vb, &ptrs)
    );
}

#[test]
fn reordered_non_ascii_keys_fingerprint_the_same() {
    // U+E000 sorts before U+1F600 in UTF-16 (the canonical order), after it in UTF-8.
    let a = "{\"\u{e9}\":1,\"z\":2,\"\u{1F600}\":3,\"\u{E000}\":4}";
    let b = "{\"\u{E000}\":4,\"\u{1F600}\":3,\"z\":2,\"\u{e9}\":1}";
    assert_eq!(fp(a), fp(b));
    let v: serde_json::Value = serde_json::from_str(b).expect("JSON");
    assert_eq!(canonical_json(&v), "{\"z\":2,\"\u{e9}\":1,\"\u{1F600}\":3,\"\u{E000}\":4}");
}

/// The same digests as the default build (pinned in idem-core's own tests): turning the feature
/// on changes no fingerprint a store already holds.
#[test]
fn digests_match_the_default_build() {
    assert_eq!(
        fp(r#"{"b":[1,2.0,"x\"y"],"a":{"\u00e9":null,"z":true}}"#).to_string(),
        "f6ab2826ef2fc36802ce22e3f3efc42db81ae59395490020287521c4835bff62"
    );
    assert_eq!(
        fp(r#"{"\ud83d\ude00":1,"\ue000":2,"k":"\u0001"}"#).to_string(),
        "8b394f85d4d320f4d85b64f4404c44f111102f9250ac38a9f3f32f36f0db0d99"
    );
    assert_eq!(
        fp(r#"{"z":1,"a":{"y":[{"c":3,"b":2}],"x":null},"m":"s"}"#).to_string(),
        "e5fae018970d6d83cffb47f8f3892c364be87573254d00a97627dbfb40b88ffa"
    );
}
