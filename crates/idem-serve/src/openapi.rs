//! The OpenAPI 3.1 document, derived from the handlers and wire types (served at
//! `/openapi.json`).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use axum::response::{IntoResponse, Response};

use crate::http;
use crate::wire::*;

/// The claim API's document. `ApiDoc::openapi()` builds it; `idem serve` serves it.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem claim API",
        description = "Exactly-once effects for services in any language: claim a key before an \
                       effect, complete it after; duplicates, conflicts and takeovers are decided \
                       by the store. Version 1: fields may be added to answers, never removed.",
        license(name = "MIT OR Apache-2.0")
    ),
    paths(
        http::claim, http::claim_batch, http::complete, http::complete_batch, http::fail,
        http::release, http::extend, http::inspect, http::list, http::stats, http::force_release,
        http::force_fail, http::purge, http::healthz, http::readyz, http::metrics_text, document
    ),
    components(schemas(
        ClaimBody, ClaimAnswer, LeaseBody, RecordBody, ClaimBatchBody, ClaimBatchAnswer,
        CompleteBody, CompleteBatchBody, CompleteBatchAnswer, FailBody, ReleaseBody, ExtendBody,
        ExtendAnswer, ForceFailBody, Changed, PurgeBody, Purged, CountsBody, RecordList, Problem
    )),
    modifiers(&Bearer),
    tags(
        (name = "claims", description = "Claim keys before their effects"),
        (name = "leases", description = "End or extend a lease"),
        (name = "operators", description = "Inspect, release, fail and purge records"),
        (name = "health", description = "Liveness, readiness, metrics")
    )
)]
pub struct ApiDoc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "health",
    responses((status = 200, description = "OpenAPI 3.1", content_type = "application/json", body = Object)))]
pub(crate) async fn document() -> Response {
    ([("content-type", "application/json")], ApiDoc::openapi().to_json().unwrap_or_default())
        .into_response()
}
