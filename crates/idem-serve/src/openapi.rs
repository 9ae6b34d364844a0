//! The OpenAPI 3.1 document, derived from the handlers and wire types (served at
//! `/openapi.json`).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::api;
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
        api::claim, api::claim_batch, api::complete, api::complete_batch, api::fail, api::release,
        api::extend, api::inspect, api::list, api::stats, api::force_release, api::force_fail,
        api::purge, api::healthz, api::readyz, api::metrics_text, api::openapi
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
