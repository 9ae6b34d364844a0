//! Key extractors: JSON pointer, CloudEvents (structured and binary), headers.

use idem_core::extract::{
    CloudEvents, CloudEventsMode, ExtractError, Header, JsonPointer, KeyExtractor, Message,
    MessageId,
};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::config;
use super::json::{text, value};

/// Payloads: arbitrary bytes, JSON-ish token soup, or real JSON documents.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        r#"[\[\]{}:,"0-9eE.+\- \\u/a-fnlrst~]{0,48}"#.prop_map(String::into_bytes),
        value().prop_map(|v| v.to_string().into_bytes()),
        (text(), text(), value()).prop_map(|(s, i, t)| {
            json!({"specversion": "1.0", "source": s, "id": i, "type": t}).to_string().into_bytes()
        }),
    ]
}

/// A non-empty key text.
fn key_text() -> impl Strategy<Value = String> {
    text().prop_filter("non-empty", |s| !s.is_empty())
}

/// Header names an extractor may look for, in several cases and spellings.
fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "ce-source",
            "ce-id",
            "CE-Source",
            "Ce-Id",
            "ce_source",
            "ce_id",
            "cloudEvents:source",
            "cloudevents:ID",
            "idempotency-key",
            "Idempotency-Key",
            "",
        ])
        .prop_map(str::to_owned),
        text(),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    proptest::collection::vec((header_name(), text()), 0..6)
}

fn message(payload: Vec<u8>, headers: &[(String, String)]) -> Message {
    headers.iter().fold(Message::new(payload), |m, (n, v)| m.with_header(n, v))
}

/// `seg` escaped as an RFC 6901 reference token.
fn token(seg: &str) -> String {
    seg.replace('~', "~0").replace('/', "~1")
}

/// `leaf` placed at `path` inside `doc` (objects are made where the path needs them).
fn place(doc: Value, path: &[String], leaf: Value) -> Value {
    let Some((first, rest)) = path.split_first() else { return leaf };
    let mut map = match doc {
        Value::Object(map) => map,
        _ => serde_json::Map::new(),
    };
    let inner = map.remove(first).unwrap_or(Value::Null);
    map.insert(first.clone(), place(inner, rest, leaf));
    Value::Object(map)
}

proptest! {
    #![proptest_config(config())]

    /// Any payload and any pointer: a non-empty key, or an error naming the pointer.
    #[test]
    fn json_pointer_never_panics_and_errors_name_the_pointer(
        payload in payload(),
        pointer in prop_oneof![text(), r"(/[a-z~01]{0,3}){0,3}"],
    ) {
        match JsonPointer::new(pointer.clone()).extract(&Message::new(payload)) {
            Ok(k) => prop_assert!(!k.is_empty()),
            Err(e) => {
                let named = format!("JSON pointer `{pointer}`");
                prop_assert!(e.to_string().contains(&named), "{e}");
            }
        }
    }

    /// A string or integer key anywhere in any document, under any member names (with `/` and
    /// `~` escaped), comes back exactly: strings as they are, integers in decimal.
    #[test]
    fn json_pointer_key_round_trips(
        doc in value(),
        path in proptest::collection::vec(text(), 0..4),
        key in prop_oneof![
            key_text().prop_map(Value::String),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
        ],
        pretty in any::<bool>(),
    ) {
        let expected = match &key {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let doc = place(doc, &path, key);
        let bytes = if pretty { serde_json::to_vec_pretty(&doc)? } else { serde_json::to_vec(&doc)? };
        let pointer: String = path.iter().map(|seg| format!("/{}", token(seg))).collect();
        prop_assert_eq!(JsonPointer::new(pointer).extract(&Message::new(bytes))?, expected);
    }

    /// A value that cannot be a key is refused, naming the pointer: `null` as missing, the
    /// rest (booleans, fractions, arrays, objects, the empty string) as invalid.
    #[test]
    fn json_pointer_refuses_unusable_values(
        doc in value(),
        path in proptest::collection::vec(text(), 0..3),
        bad in prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            Just(json!(1.5)),
            Just(json!(-0.25)),
            Just(json!("")),
            proptest::collection::vec(value(), 0..3).prop_map(Value::Array),
            Just(json!({})),
        ],
    ) {
        let is_null = bad.is_null();
        let doc = place(doc, &path, bad);
        let pointer: String = path.iter().map(|seg| format!("/{}", token(seg))).collect();
        let e = JsonPointer::new(pointer.clone())
            .extract(&Message::new(doc.to_string().into_bytes()))
            .unwrap_err();
        prop_assert_eq!(e.is_missing(), is_null, "{}", e);
        let kind_ok = matches!(e, ExtractError::Missing { .. } | ExtractError::Invalid { .. });
        prop_assert!(kind_ok, "{:?}", e);
        prop_assert!(e.to_string().contains(&format!("JSON pointer `{pointer}`")), "{}", e);
    }

    /// Any payload and headers, in every mode: a well-formed length-prefixed key, or an error
    /// naming CloudEvents.
    #[test]
    fn cloudevents_never_panics_and_errors_name_cloudevents(
        payload in payload(),
        headers in headers(),
        mode in prop::sample::select(vec![
            CloudEventsMode::Auto, CloudEventsMode::Structured, CloudEventsMode::Binary,
        ]),
    ) {
        match CloudEvents(mode).extract(&message(payload, &headers)) {
            Ok(k) => {
                let (len, rest) = k.split_once(':').unwrap();
                let len: usize = len.parse()?;
                prop_assert!(len > 0 && len < rest.len() && rest.is_char_boundary(len), "{}", k);
            }
            Err(e) => prop_assert!(e.to_string().contains("CloudEvents"), "{e}"),
        }
    }

    /// The same event in structured and in binary mode (any of the three header spellings,
    /// any ASCII case) gives the same key, `<len(source)>:<source><id>`.
    #[test]
    fn cloudevents_modes_agree(
        source in key_text(),
        id in key_text(),
        prefix in prop::sample::select(vec!["ce-", "ce_", "cloudEvents:"]),
        upper in proptest::collection::vec(any::<bool>(), 16),
        noise in headers(),
    ) {
        let expected = format!("{}:{source}{id}", source.len());
        let structured =
            json!({"specversion": "1.0", "source": source, "id": id, "type": "t"}).to_string();
        let s = Message::new(structured.into_bytes());
        prop_assert_eq!(&CloudEvents(CloudEventsMode::Structured).extract(&s)?, &expected);
        prop_assert_eq!(&CloudEvents(CloudEventsMode::Auto).extract(&s)?, &expected);

        let cased = |name: String| -> String {
            name.chars()
                .zip(upper.iter().cycle())
                .map(|(c, &u)| if u { c.to_ascii_uppercase() } else { c.to_ascii_lowercase() })
                .collect()
        };
        // The attributes come first: a later header of the same name does not override them.
        let mut all = vec![
            (cased(format!("{prefix}source")), source.clone()),
            (cased(format!("{prefix}id")), id.clone()),
        ];
        // Other headers, but no other spelling of the attributes (`ce-` is read before `ce_`).
        let attribute = |n: &str| {
            let n = n.to_ascii_lowercase();
            ["ce-", "ce_", "cloudevents:"].iter().any(|p| n.starts_with(p))
        };
        all.extend(noise.into_iter().filter(|(n, _)| !attribute(n)));
        let b = message(b"not json".to_vec(), &all);
        prop_assert_eq!(&CloudEvents(CloudEventsMode::Binary).extract(&b)?, &expected);
        prop_assert_eq!(&CloudEvents(CloudEventsMode::Auto).extract(&b)?, &expected);
    }

    /// Distinct `(source, id)` pairs never share a key, even when their concatenations match.
    #[test]
    fn cloudevents_keys_are_injective(
        source in key_text(),
        id in key_text(),
        shift in 1usize..4,
        other_source in key_text(),
        other_id in key_text(),
    ) {
        let key = |s: &str, i: &str| {
            let m = Message::new(b"{}".to_vec()).with_header("ce-source", s).with_header("ce-id", i);
            CloudEvents(CloudEventsMode::Binary).extract(&m)
        };
        // Move up to `shift` characters from the front of `id` to the end of `source`.
        let moved: String = id.chars().take(shift).collect();
        let pairs = [
            (source.clone(), id.clone()),
            (format!("{source}{moved}"), id[moved.len()..].to_owned()),
            (other_source, other_id),
        ];
        for (a, b) in [(0, 1), (0, 2), (1, 2)] {
            let (pa, pb) = (&pairs[a], &pairs[b]);
            if pa.1.is_empty() || pb.1.is_empty() {
                continue;
            }
            prop_assert_eq!(pa == pb, key(&pa.0, &pa.1)? == key(&pb.0, &pb.1)?, "{:?} {:?}", pa, pb);
        }
    }

    /// A header extractor returns the first header of that name (ASCII case ignored); an absent
    /// one is missing and an empty one invalid, both naming the header.
    #[test]
    fn header_extractor_takes_the_first_match(headers in headers(), wanted in header_name()) {
        let m = message(Vec::new(), &headers);
        let first = headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(&wanted));
        let named = format!("header `{wanted}`");
        match (Header::new(wanted.clone()).extract(&m), first) {
            (Ok(k), Some((_, v))) => prop_assert_eq!(&k, v),
            (Err(e @ ExtractError::Missing { .. }), None) => {
                prop_assert!(e.to_string().contains(&named), "{e}");
            }
            (Err(e @ ExtractError::Invalid { .. }), Some((_, v))) if v.is_empty() => {
                prop_assert!(e.to_string().contains(&named), "{e}");
            }
            (r, f) => prop_assert!(false, "{r:?} for first match {f:?}"),
        }
    }

    /// The message id extractor: the id itself, missing when absent, invalid when empty.
    #[test]
    fn message_id_extractor(id in proptest::option::of(text())) {
        let m = id.iter().fold(Message::new(Vec::new()), |m, i| m.with_message_id(i));
        match (MessageId.extract(&m), id.as_deref()) {
            (Ok(k), Some(i)) => prop_assert_eq!(k, i),
            (Err(e), None) => prop_assert!(e.is_missing() && e.to_string().contains("message id")),
            (Err(e @ ExtractError::Invalid { .. }), Some("")) => {
                prop_assert!(e.to_string().contains("message id"));
            }
            (r, i) => prop_assert!(false, "{r:?} for {i:?}"),
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// The engine parses a payload once for its key and its fingerprint: an extractor reading
    /// that parse answers exactly what it answers parsing the payload itself (keys and error
    /// messages alike), for every extractor and any payload that is JSON.
    #[test]
    fn extract_parsed_answers_what_extract_answers(
        payload in payload(),
        pointer in prop_oneof![text(), r"(/[a-z~01]{0,3}){0,3}", Just("/source".to_owned())],
        headers in headers(),
    ) {
        let Ok(json) = serde_json::from_slice::<Value>(&payload) else { return Ok(()) };
        let msg = message(payload, &headers);
        let extractors: Vec<Box<dyn KeyExtractor>> = vec![
            Box::new(JsonPointer::new(pointer.clone())),
            Box::new(MessageId),
            Box::new(Header::new("idempotency-key")),
            Box::new(CloudEvents(CloudEventsMode::Auto)),
            Box::new(idem_core::extract::FirstOf(vec![
                Box::new(Header::new("idempotency-key")),
                Box::new(JsonPointer::new(pointer.clone())),
            ])),
            Box::new(idem_core::extract::Join(vec![
                Box::new(JsonPointer::new("/id")),
                Box::new(JsonPointer::new(pointer)),
            ])),
        ];
        for x in &extractors {
            let (own, shared) = (x.extract(&msg), x.extract_parsed(&msg, &json));
            prop_assert_eq!(
                own.as_ref().map_err(ToString::to_string),
                shared.as_ref().map_err(ToString::to_string),
                "{:?}", x
            );
        }
    }
}
