//! A fake external payment API: it charges cards, and deduplicates by idempotency key the way
//! real payment APIs do (a repeated key returns the first charge instead of charging again).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
struct Ledger {
    by_key: HashMap<String, u64>,
    charges: Vec<(String, u64)>, // (order id, cents)
}

#[derive(Default)]
pub(crate) struct PaymentApi {
    ledger: Mutex<Ledger>,
}

impl PaymentApi {
    /// Charges `cents` for `order`; a repeated `idempotency_key` charges nothing and returns the
    /// first charge's id. Takes a little time, as a network call does.
    pub(crate) async fn charge(&self, idempotency_key: &str, order: &str, cents: u64) -> u64 {
        tokio::time::sleep(Duration::from_micros(300)).await;
        let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = l.by_key.get(idempotency_key) {
            return *id;
        }
        l.charges.push((order.to_owned(), cents));
        let id = l.charges.len() as u64;
        l.by_key.insert(idempotency_key.to_owned(), id);
        id
    }

    /// Orders charged more than once.
    pub(crate) fn charged_twice(&self) -> usize {
        let l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let mut per_order: HashMap<&str, usize> = HashMap::new();
        for (order, _) in &l.charges {
            *per_order.entry(order).or_default() += 1;
        }
        per_order.values().filter(|n| **n > 1).count()
    }

    /// Orders charged at least once.
    pub(crate) fn charged_orders(&self) -> usize {
        let l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        l.charges.iter().map(|(o, _)| o.as_str()).collect::<std::collections::HashSet<_>>().len()
    }
}
