//! The gRPC service on the same port as the HTTP API: the same outcomes, the same access
//! control, errors as gRPC status codes.

use crate::common;

use idem_core::MemoryStore;
use idem_serve::grpc::pb::claim_answer::Outcome;
use idem_serve::grpc::pb::claims_client::ClaimsClient;
use idem_serve::grpc::pb::{ClaimRequest, CompleteRequest, InspectRequest, StatsRequest};
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let v: MetadataValue<_> = format!("Bearer {token}").parse().expect("metadata");
    r.metadata_mut().insert("authorization", v);
    r
}

fn claim(scope: &str, key: &str, payload: &[u8]) -> ClaimRequest {
    ClaimRequest {
        scope: scope.into(),
        key: key.into(),
        payload: Some(payload.to_vec()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_over_grpc_match_the_http_api() {
    let server = common::serve(MemoryStore::new()).await;
    let channel =
        Channel::from_shared(server.base()).expect("uri").connect().await.expect("connect");
    let mut client = ClaimsClient::new(channel);
    let token = common::ORDERS;

    let a =
        client.claim(with_token(claim("orders", "g-1", b"{\"n\":1}"), token)).await.expect("claim");
    let Some(Outcome::Acquired(acq)) = a.into_inner().outcome else { panic!("acquired") };
    assert!(acq.downstream_key.starts_with("idem-"));
    let lease = acq.lease.expect("lease");
    assert_eq!(lease.attempt, 1);

    // In progress for a second caller; a conflict with another payload.
    let b =
        client.claim(with_token(claim("orders", "g-1", b"{\"n\":1}"), token)).await.expect("claim");
    assert!(matches!(b.into_inner().outcome, Some(Outcome::InProgress(_))));
    let c =
        client.claim(with_token(claim("orders", "g-1", b"{\"n\":2}"), token)).await.expect("claim");
    assert!(matches!(c.into_inner().outcome, Some(Outcome::Conflict(_))));

    let done = CompleteRequest {
        lease: Some(lease.clone()),
        result: Some(b"paid".to_vec()),
        retain_ms: None,
    };
    client.complete(with_token(done.clone(), token)).await.expect("complete");
    let d =
        client.claim(with_token(claim("orders", "g-1", b"{\"n\":1}"), token)).await.expect("claim");
    let Some(Outcome::Duplicate(rec)) = d.into_inner().outcome else { panic!("duplicate") };
    assert_eq!((rec.state.as_str(), rec.result.as_deref()), ("completed", Some(&b"paid"[..])));

    // A spent lease is lost: FAILED_PRECONDITION, with the problem type in the metadata.
    let e = client.complete(with_token(done, token)).await.expect_err("lease lost");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(e.metadata().get("idem-problem").and_then(|v| v.to_str().ok()), Some("lease_lost"));

    // Access control as over HTTP.
    let e = client.claim(with_token(claim("payments", "p", b"x"), token)).await.expect_err("scope");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e =
        client.claim(tonic::Request::new(claim("orders", "x", b"x"))).await.expect_err("no token");
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = client
        .stats(with_token(StatsRequest { scope: None }, token))
        .await
        .expect_err("all scopes");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = client
        .claim(with_token(ClaimRequest { lease_ms: Some(0), ..claim("orders", "y", b"y") }, token))
        .await
        .expect_err("lease_ms 0");
    assert_eq!(
        (e.code(), e.metadata().get("idem-field").and_then(|v| v.to_str().ok())),
        (Code::InvalidArgument, Some("lease_ms"))
    );

    let rec = client
        .inspect(with_token(
            InspectRequest { scope: "orders".into(), key: "g-1".into() },
            common::ADMIN,
        ))
        .await
        .expect("inspect")
        .into_inner();
    assert_eq!(rec.state, "completed");
    let e = client
        .inspect(with_token(
            InspectRequest { scope: "orders".into(), key: "none".into() },
            common::ADMIN,
        ))
        .await
        .expect_err("absent");
    assert_eq!(e.code(), Code::NotFound);
    let counts =
        client.stats(with_token(StatsRequest { scope: None }, common::ADMIN)).await.expect("stats");
    assert_eq!(counts.into_inner().completed, 1);
}
