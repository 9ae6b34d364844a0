//! `src/grpc/pb.rs` is what `proto/idem/v1/claims.proto` generates today: the checked-in code
//! cannot drift from the `.proto` clients are built from. With `IDEM_REGENERATE=1` the test
//! writes the file instead of comparing (after changing the `.proto`).

use std::path::Path;

#[test]
fn generated_grpc_code_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let descriptors =
        protox::compile([root.join("proto/idem/v1/claims.proto")], [root.join("proto")])
            .expect("the .proto compiles");
    let out = tempfile::tempdir().expect("tempdir");
    tonic_prost_build::configure()
        .build_transport(false)
        .out_dir(out.path())
        .compile_fds(descriptors)
        .expect("code generation");
    let generated = std::fs::read_to_string(out.path().join("idem.v1.rs")).expect("generated");
    let generated = format!(
        "// @generated from proto/idem/v1/claims.proto by tests/it/grpc_codegen.rs; do not edit.\n{generated}"
    );
    let checked_in = root.join("src/grpc/pb.rs");
    if std::env::var("IDEM_REGENERATE").is_ok_and(|v| v == "1") {
        std::fs::write(&checked_in, &generated).expect("write pb.rs");
        return;
    }
    let current = std::fs::read_to_string(&checked_in).unwrap_or_default();
    assert!(
        current == generated,
        "src/grpc/pb.rs is not what the .proto generates: run \
         IDEM_REGENERATE=1 cargo test -p idem-serve --test it grpc_codegen::"
    );
}
