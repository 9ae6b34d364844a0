//! `ServeConfig`'s parsing and checks.
use super::*;

fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
}

#[test]
fn the_documented_example_parses() {
    let text = include_str!("mod.rs")
        .split("```toml\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("example")
        .lines()
        .map(|l| l.strip_prefix("//! ").or_else(|| l.strip_prefix("//!")).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let c = ServeConfig::from_toml(&text).expect("parses");
    c.check_push().expect("valid push");
    c.check_console().expect("valid console");
    assert!(c.console.enabled);
    assert_eq!(c.console.dead_letters[0].queue, "PAYMENTS");
    let e =
        env(&[("IDEM_STORE", "postgres://x"), ("IDEM_TOKEN_ORDERS", "0123456789abcdef-orders")]);
    assert_eq!(c.store_url(&e).expect("url"), "postgres://x");
    assert_eq!(c.tokens(&e).expect("tokens").len(), 1);
}

#[test]
fn tokens_come_from_the_environment_too() {
    let c = ServeConfig::empty();
    let e = env(&[(
        "IDEM_SERVE_TOKENS",
        "a:orders,payments:0123456789abcdef:x; ops:*:fedcba9876543210",
    )]);
    let t = c.tokens(e).expect("tokens");
    assert_eq!(t.len(), 2);
    assert!(matches!(
        c.tokens(env(&[])),
        Err(ConfigError::Invalid { field, .. }) if field == "auth.tokens"
    ));
}

#[test]
fn secrets_name_every_address_and_token_the_configuration_holds() {
    let c = ServeConfig::from_toml(
        r#"
[store]
url_env = "STORE"
[[auth.tokens]]
name = "file"
token = "file-token-0123456789"
scopes = ["*"]
[[auth.tokens]]
name = "env"
token_env = "TOKEN"
scopes = ["orders"]
[[push]]
name = "orders"
broker = "amqp://u:broker-pw@h/%2f"
source = "orders"
dead_letter = "orders.dlq"
scope = "orders"
endpoint = "http://u:endpoint-pw@app/orders"
proxy = "http://u:proxy-pw@proxy:3128"
[console]
outbox_env = "OUTBOX"
"#,
    )
    .expect("parses");
    let e = env(&[
        ("STORE", "postgres://u:store-pw@db/x"),
        ("TOKEN", "env-token-0123456789"),
        ("OUTBOX", "mysql://u:outbox-pw@db/x"),
        ("IDEM_SERVE_TOKENS", "a:orders:listed-token-0123; malformed"),
    ]);
    let (addresses, tokens) = c.secrets(e);
    let all = format!("{addresses:?} {tokens:?}");
    for secret in ["store-pw", "broker-pw", "endpoint-pw", "proxy-pw", "outbox-pw"] {
        assert!(addresses.iter().any(|a| a.contains(secret)), "{secret} missing: {all}");
    }
    assert_eq!(tokens, ["file-token-0123456789", "env-token-0123456789", "listed-token-0123"]);
}

#[test]
fn anonymous_only_on_loopback() {
    let mut c = ServeConfig::from_toml("[auth]\nanonymous = true").expect("parses");
    assert!(c.tokens(env(&[])).expect("loopback").is_anonymous());
    c.listen = "0.0.0.0:7700".into();
    assert!(c.tokens(env(&[])).is_err());
    c.listen = "[::1]:7700".into();
    assert!(c.tokens(env(&[])).is_ok());
}

#[test]
fn console_names_are_unique_and_brokers_given_once() {
    let push = "[[push]]\nname='orders'\nbroker='redis://x'\nsource='s'\ndead_letter='d'\n\
                scope='s'\nendpoint='http://x'\n";
    let twice = format!(
        "{push}[console]\nenabled=true\n[[console.dead_letters]]\nname='orders'\n\
         broker='redis://x'\nqueue='q'\n"
    );
    let err = ServeConfig::from_toml(&twice).expect("parses").check_console().expect_err("twice");
    assert!(err.to_string().contains("console.dead_letters[0].name"), "{err}");
    let off = twice.replace("enabled=true", "enabled=true\npush_dead_letters=false");
    ServeConfig::from_toml(&off).expect("parses").check_console().expect("no clash");
    let no_broker = "[[console.dead_letters]]\nname='a'\nqueue='q'\n";
    let err =
        ServeConfig::from_toml(no_broker).expect("parses").check_console().expect_err("broker");
    assert!(err.to_string().contains("broker"), "{err}");
    let c = ServeConfig::from_toml("[console]\noutbox_env='OUTBOX'").expect("parses");
    assert!(c.console_outbox_url(env(&[])).is_err());
    assert_eq!(
        c.console_outbox_url(env(&[("OUTBOX", "/tmp/o.db")])).expect("url").as_deref(),
        Some("/tmp/o.db")
    );
}

#[test]
fn bad_values_name_their_field() {
    let err = ServeConfig::from_toml("listen = 3").expect_err("type");
    assert!(err.to_string().contains("listen"), "{err}");
    let c = ServeConfig::from_toml(
        "[[push]]\nname='a'\nbroker='amqp://x'\nsource='q'\ndead_letter='d'\nscope='s'\n\
         endpoint='http://x'\ntimeout_ms=1000\nlease_ms=2000",
    )
    .expect("parses");
    let err = c.check_push().expect_err("lease too short");
    assert!(err.to_string().contains("push[0].lease_ms"), "{err}");
    assert!(ServeConfig::from_toml("bogus = 1").is_err());
}
