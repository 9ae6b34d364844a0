//! `idem relay --wal-slot SLOT`: relays the WAL outbox read from a logical replication slot.

use std::time::Duration;

use anyhow::Context as _;
use idem::outbox::Publisher;
use idem::postgres::{PostgresWalOutbox, WalRelay};
use idem::sqlx::PgPool;

use super::{RelayArgs, Source, to_broker};

pub(super) async fn run(pool: PgPool, slot: &str, args: &RelayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.retry_parked.is_none(),
        "--retry-parked: a WAL outbox parks nothing (a message the broker refuses stops the relay)"
    );
    let outbox =
        PostgresWalOutbox::new(pool).with_slot_name(slot)?.with_prefix(&args.wal_prefix)?;
    if args.drop_slot {
        outbox.drop_slot().await?;
        println!("slot {slot} dropped");
        return Ok(());
    }
    if args.stats {
        return print_lag(&outbox).await;
    }
    // Created when missing, as the table relay creates its table.
    outbox.create_slot().await.with_context(|| format!("creating slot {slot}"))?;
    if args.create_slot {
        println!("slot {slot} ready");
        return Ok(());
    }
    to_broker(Wal(outbox), args).await
}

struct Wal(PostgresWalOutbox);

impl Source for Wal {
    async fn relay<P: Publisher>(self, publisher: P, args: &RelayArgs) -> anyhow::Result<()> {
        let relay = WalRelay::builder(self.0, publisher)
            .batch(args.batch.unwrap_or(4096))
            .publish_timeout(Duration::from_secs(args.lease_secs).max(Duration::from_secs(1)) / 3)
            .max_attempts(args.max_attempts)
            .build()?;
        let started = std::time::Instant::now();
        let report = if args.once {
            relay.run_until_empty().await?
        } else {
            let stop = crate::signals::shutdown()?;
            eprintln!("relaying slot {} until SIGTERM or Ctrl-C", relay.store().slot());
            relay.run(stop).await?
        };
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{report} in {secs:.1} s ({:.0} msgs/s)",
            report.published as f64 / secs.max(1e-9)
        );
        print_lag(relay.store()).await
    }
}

async fn print_lag(outbox: &PostgresWalOutbox) -> anyhow::Result<()> {
    match outbox.lag_bytes().await? {
        Some(lag) => println!("slot {}: lag {lag} bytes", outbox.slot()),
        None => println!("slot {}: does not exist", outbox.slot()),
    }
    Ok(())
}
