use super::*;

#[test]
fn parses_durations_and_intervals() {
    assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
    assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
    assert!(parse_duration("5 parsecs").is_err());
    let i = parse_interval("150ms..1s").ok();
    assert_eq!(
        i.map(|i| (i.min, i.max)),
        Some((Duration::from_millis(150), Duration::from_secs(1)))
    );
    assert!(parse_interval("1s..100ms").is_err());
    assert!(parse_interval("1s").is_err());
}

#[test]
fn workers_get_the_urls_in_their_environment_not_in_argv() {
    use clap::Parser as _;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        chaos: ChaosArgs,
    }
    let (broker, store) =
        ("amqp://u:Planted1@127.0.0.1:1/%2f", "postgres://u@h/db?password=Planted2");
    let cli = Cli::try_parse_from(["chaos", "--broker", broker, "--store", store]);
    let args = cli.map(|c| c.chaos).map_err(|e| e.to_string());
    let args = args.as_ref().map_err(String::as_str);
    let Ok(args) = args else { panic!("{args:?}") };
    let cmd = Worker::command(std::path::Path::new("idem"), args, "t1", &Role::Consumer);
    let argv: Vec<_> = cmd.as_std().get_args().map(|a| a.to_string_lossy()).collect();
    assert!(argv.iter().all(|a| !a.contains("Planted")), "{argv:?}");
    assert!(argv.contains(&"--worker".into()) && argv.contains(&"t1".into()), "{argv:?}");
    let env: std::collections::HashMap<_, _> = cmd.as_std().get_envs().collect();
    assert_eq!(
        env.get(std::ffi::OsStr::new(BROKER_ENV)),
        Some(&Some(std::ffi::OsStr::new(broker)))
    );
    assert_eq!(env.get(std::ffi::OsStr::new(STORE_ENV)), Some(&Some(std::ffi::OsStr::new(store))));
}
