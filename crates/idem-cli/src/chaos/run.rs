//! One chaos run: publish the plan, run the workers under faults, drain, and judge.

use super::broker::{Admin, BrokerUrl};
use super::store::{Ledger, Names, StoreUrl};
use super::verdict::{Events, Published, REUSED, Table, Tally};
use anyhow::Context as _;
use idem::outbox::OutboxMessage;
use idem::redact::Redacted;
use rand::Rng;
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

use super::*;

/// Publishes, runs the workers under faults, drains, prints the table; the exit code.
pub(super) async fn verify(
    args: &ChaosArgs,
    plan: &Plan,
    broker: &BrokerUrl,
    admin: &Admin,
    store: &StoreUrl,
    names: &Names,
    ledger: &Ledger,
) -> anyhow::Result<u8> {
    let started = Instant::now();
    let destination = broker.destination(&plan.tag);
    let first: Vec<OutboxMessage> = plan
        .first
        .iter()
        .map(|(id, body)| message(&destination, id, body))
        .collect::<anyhow::Result<_>>()?;
    admin.publish(&first).await?;
    // No reused id goes out inside JetStream's duplicate window of its original, which would
    // drop it unseen.
    let reuse_from = Instant::now() + 2 * broker::NATS_DUPLICATE_WINDOW;
    // Push mode: the sidecars' configuration names the application's port, which survives
    // its restarts (the port is bound again by the next application process).
    let push_dir = tempfile::tempdir().context("a directory for the sidecars' configuration")?;
    let role = if args.push {
        let port = free_port()?;
        let config = push_dir.path().join("serve.toml");
        std::fs::write(&config, push_config(args, broker, &plan.tag, names, port))
            .context("writing the sidecars' configuration")?;
        Some((Role::Sidecar(config), port))
    } else {
        None
    };
    let mut workers = Vec::with_capacity(args.workers + 1);
    if let Some((_, port)) = &role {
        workers.push(Worker::start(args, &plan.tag, Role::App(*port)).await?);
    }
    for _ in 0..args.workers {
        let r = role.as_ref().map_or(Role::Consumer, |(r, _)| r.clone());
        workers.push(Worker::start(args, &plan.tag, r).await?);
    }
    let goal = (plan.unique.len() + plan.reused.len() + plan.poison.len()) as u64;
    let bar = indicatif::ProgressBar::new(goal).with_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} settled  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut events = Events::default();
    let mut pending_reused: Vec<String> = plan.reused.clone();
    let mut rng = rand::rng();
    let pause = |rng: &mut rand::rngs::ThreadRng| {
        rng.random_range(args.kill_every.min..=args.kill_every.max)
    };
    let mut next_kill = Instant::now() + pause(&mut rng);
    let mut stall: Option<(usize, Instant)> = None;
    let mut stall_done = !args.stall;
    let mut next_poll = Instant::now();
    let mut quiet_polls = 0;
    // What the last poll saw, and when it last changed: the run gives up on no progress.
    // (A newly settled id always comes with a new effect or dead letter.)
    let mut seen = (0, 0, 0);
    let mut progressed = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = Instant::now();
        // Workers that ended by themselves are replaced like killed ones.
        for w in &mut workers {
            if w.child.try_wait()?.is_some() {
                events.worker_exits += 1;
                let role = w.role.clone();
                *w = Worker::start(args, &plan.tag, role).await?;
            }
        }
        if now >= next_kill {
            kill_one(&mut workers, &mut events, &mut rng, args, &plan.tag).await?;
            next_kill = Instant::now() + pause(&mut rng);
        }
        if let Some((i, until)) = stall
            && now >= until
        {
            workers[i].signal("-CONT")?;
            workers[i].stalled = false;
            events.stalls += 1;
            stall = None;
            stall_done = true;
        }
        if now < next_poll {
            continue;
        }
        // Reading the ledger takes seconds once it holds hundreds of thousands of rows: the
        // kills go on meanwhile, and the next read waits twice as long as this one took.
        let (effects, dead, backlog) = {
            let poll = async {
                let effects = ledger.effects(store, names).await?;
                let dead = admin.dead_letters().await?;
                let backlog = admin.backlog().await?;
                anyhow::Ok((effects, dead, backlog))
            };
            tokio::pin!(poll);
            loop {
                tokio::select! {
                    r = &mut poll => break r?,
                    () = tokio::time::sleep_until(next_kill) => {
                        kill_one(&mut workers, &mut events, &mut rng, args, &plan.tag).await?;
                        next_kill = Instant::now() + pause(&mut rng);
                    }
                }
            }
        };
        let now = Instant::now();
        next_poll = now + Duration::from_millis(250).max(now.duration_since(next_poll) * 2);
        let applied: HashSet<&str> = effects.iter().map(|e| e.id.as_str()).collect();
        // A reused id is published once its original has an effect, so the reused body is
        // always the later one: idem must call it a conflict.
        let (due, later): (Vec<String>, Vec<String>) = pending_reused
            .drain(..)
            .partition(|id| now >= reuse_from && applied.contains(id.as_str()));
        pending_reused = later;
        if !due.is_empty() {
            let msgs: Vec<OutboxMessage> = due
                .iter()
                .map(|id| message(&destination, id, REUSED))
                .collect::<anyhow::Result<_>>()?;
            admin.publish(&msgs).await?;
        }
        let settled = plan.unique.iter().filter(|id| applied.contains(id.as_str())).count()
            + plan
                .reused
                .iter()
                .filter(|id| dead.contains(*id) || applied_reused(&effects, id))
                .count()
            + plan
                .poison
                .iter()
                .filter(|id| dead.contains(*id) || applied.contains(id.as_str()))
                .count();
        bar.set_position(settled as u64);
        bar.set_message(format!("kills {}  stalls {}", events.kills, events.stalls));
        if !stall_done && stall.is_none() && settled as u64 * 5 >= goal {
            let i = rng.random_range(0..workers.len());
            workers[i].signal("-STOP")?;
            workers[i].stalled = true;
            stall = Some((i, now + args.lease + (args.lease / 2).max(Duration::from_secs(1))));
        }
        let complete = settled as u64 == goal && pending_reused.is_empty() && stall.is_none();
        quiet_polls = if complete && backlog == 0 { quiet_polls + 1 } else { 0 };
        // Three quiet polls in a row: what the workers hold has been settled.
        if quiet_polls >= 3 {
            break;
        }
        let state = (effects.len(), dead.len(), backlog);
        if state != seen {
            seen = state;
            progressed = now;
        }
        events.longest_idle = events.longest_idle.max(now.duration_since(progressed));
        if now.duration_since(progressed) >= args.timeout {
            eprintln!(
                "idem chaos: nothing progressed for {:?} ({settled} of {goal} settled, {backlog} \
                 in the broker); giving up",
                args.timeout
            );
            events.timed_out = true;
            break;
        }
    }
    bar.finish_and_clear();
    if let Some((i, _)) = stall {
        workers[i].signal("-CONT")?;
    }
    // The application last: sidecars finishing their in-flight pushes still need it.
    workers.rotate_left(usize::from(args.push));
    for mut w in workers {
        w.stop()?;
        if tokio::time::timeout(Duration::from_secs(30), w.child.wait()).await.is_err() {
            eprintln!("a worker did not stop within 30 s of its stdin closing; killed");
            w.child.kill().await?;
        }
    }
    events.left_in_broker = admin.backlog().await?;
    events.wall = started.elapsed();
    let effects = ledger.effects(store, names).await?;
    let reused: HashSet<String> = plan.reused.iter().cloned().collect();
    let published = Published { unique: &plan.unique, reused: &reused, poison: &plan.poison };
    let tally = Tally::count(plan.attempted(), &published, &effects, &admin.dead_letters().await?);
    println!(
        "idem chaos: {} × {} ({} workers)",
        Redacted(&args.broker),
        store::shown(&args.store),
        args.workers
    );
    println!("{}", Table { tally: &tally, events: &events, push: args.push });
    // The offset inbox keeps one position row per partition, however often workers died.
    let positions_ok = if args.offsets {
        let rows = ledger.position_rows(store, names).await?;
        let used = admin.partitions_used().await?;
        let ok = rows == used;
        let note = if ok { "" } else { "  <-- FAIL: not one per partition with messages" };
        println!("{:<22} {rows:>10}{note}", "position rows");
        println!("{:<22} {used:>10}", "partitions used");
        ok
    } else {
        true
    };
    Ok(if tally.passed() && !events.timed_out && positions_ok { 0 } else { 1 })
}
