//! An in-memory dead-letter destination, for tests and examples.

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;

use super::*;

/// An in-memory [`DeadLetterQueue`], for tests and examples: it keeps the letters and the
/// messages republished.
#[derive(Debug, Clone, Default)]
pub struct MemoryDeadLetters {
    state: Arc<Mutex<MemoryState>>,
}

#[derive(Debug, Default)]
struct MemoryState {
    letters: Vec<Letter>,
    published: Vec<Republish>,
    fail_republish: bool,
}

impl MemoryDeadLetters {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a dead letter.
    pub fn push(&self, letter: Letter) {
        self.state().letters.push(letter);
    }

    /// How many dead letters it holds.
    pub fn len(&self) -> usize {
        self.state().letters.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every message republished so far.
    pub fn published(&self) -> Vec<Republish> {
        self.state().published.clone()
    }

    /// Makes the next republishes fail (a broker that refuses), or succeed again.
    pub fn fail_republish(&self, fail: bool) {
        self.state().fail_republish = fail;
    }
}

impl DeadLetterQueue for MemoryDeadLetters {
    fn describe(&self) -> String {
        "memory".into()
    }

    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        let out = self.state().letters.iter().take(limit).cloned().collect();
        Box::pin(async move { Ok(out) })
    }

    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        let mut st = self.state();
        let res = if st.fail_republish {
            Err(DlqError::broker("republishing", "the broker refused"))
        } else {
            st.published.extend(messages.iter().cloned());
            Ok(())
        };
        Box::pin(async move { res })
    }

    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        let mut st = self.state();
        let before = st.letters.len();
        st.letters.retain(|l| !ids.contains(&l.id));
        let n = (before - st.letters.len()) as u64;
        Box::pin(async move { Ok(n) })
    }
}
