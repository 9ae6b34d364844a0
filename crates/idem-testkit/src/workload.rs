//! Workloads for end-to-end tests.

use rand::Rng;

/// `unique` ids `{prefix}-00000`, `{prefix}-00001`…, plus `duplicates` copies of randomly chosen
/// ones, in random order: what an at-least-once producer delivers.
pub fn ids_with_duplicates(prefix: &str, unique: usize, duplicates: usize) -> Vec<String> {
    let mut rng = rand::rng();
    let mut ids: Vec<String> = (0..unique).map(|i| format!("{prefix}-{i:05}")).collect();
    for _ in 0..duplicates {
        let i = rng.random_range(0..unique);
        ids.push(format!("{prefix}-{i:05}"));
    }
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    ids
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    #[test]
    fn every_id_once_plus_the_duplicates() {
        let ids = super::ids_with_duplicates("o", 100, 20);
        assert_eq!(ids.len(), 120);
        let distinct: HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), 100);
        assert!(distinct.contains(&"o-00099".to_owned()));
    }
}
