//! Dedup keys: what an extracted key must satisfy before a store sees it.

use idem_core::{DedupKey, KeyError};
use proptest::prelude::*;

use super::config;
use super::json::text;

/// Texts around a limit: short, exactly at it, just past it; with and without NUL.
fn field(limit: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        text(),
        (0..limit + 3, any::<bool>()).prop_map(|(n, nul)| {
            let s = "é".repeat(n / 2) + &"x".repeat(n % 2);
            if nul { format!("{s}\0") } else { s }
        }),
    ]
}

/// The first rule `value` breaks, as the key's error for `field` would say it.
fn expected(field: &'static str, value: &str, limit: usize) -> Option<KeyError> {
    if value.is_empty() {
        Some(KeyError::Empty { field })
    } else if value.len() > limit {
        Some(KeyError::TooLong { field, len: value.len(), limit })
    } else {
        value.bytes().position(|b| b == 0).map(|offset| KeyError::Nul { field, offset })
    }
}

proptest! {
    #![proptest_config(config())]

    /// A key is accepted exactly when both fields are non-empty, within the limit and free of
    /// NUL; otherwise the error names the first bad field (scope first), and the limit.
    #[test]
    fn keys_are_validated_and_errors_name_field_and_limit(
        (limit, scope, id) in (1usize..24).prop_flat_map(|l| (Just(l), field(l), field(l))),
    ) {
        let want = expected("scope", &scope, limit).or_else(|| expected("id", &id, limit));
        match (DedupKey::with_limit(scope.clone(), id.clone(), limit), want) {
            (Ok(k), None) => {
                prop_assert_eq!((k.scope(), k.id()), (scope.as_str(), id.as_str()));
            }
            (Err(e), Some(w)) => {
                prop_assert_eq!(&e, &w);
                let field = if expected("scope", &scope, limit).is_some() { "scope" } else { "id" };
                prop_assert!(e.to_string().contains(&format!("dedup key {field} ")), "{}", e);
                if let KeyError::TooLong { .. } = e {
                    let named = format!("limit of {limit} bytes");
                    prop_assert!(e.to_string().contains(&named), "{}", e);
                }
            }
            (got, want) => prop_assert!(false, "{got:?}, expected {want:?}"),
        }
    }

    /// Keys are equal exactly when their fields are: no two `(scope, id)` pairs share a hash,
    /// even when their concatenations match.
    #[test]
    fn key_hashes_are_injective(scope in "[a-c/]{1,4}", id in "[a-c/]{1,4}", cut in 0usize..4) {
        let joined = format!("{scope}{id}");
        let cut = 1 + cut % (joined.len() - 1);
        let (s2, i2) = joined.split_at(cut);
        let a = DedupKey::new(scope.clone(), id.clone())?;
        let b = DedupKey::new(s2, i2)?;
        prop_assert_eq!(a.hash() == b.hash(), (scope.as_str(), id.as_str()) == (s2, i2));
        prop_assert_eq!(a == b, a.hash() == b.hash());
    }
}
