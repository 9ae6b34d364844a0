#!/usr/bin/env bash
# Every workspace crate packages, and its packaged copy compiles on its own: `cargo package
# --no-verify`, the .crate files unpacked side by side into a scratch workspace whose
# [patch.crates-io] points each idem crate at its unpacked copy (as a registry would serve
# them), then `cargo check -p CRATE --tests --examples` per crate with its default features.
# Path-only dev-dependencies (idem-testkit, the facade: they depend on the crates they test,
# so they are left out of published manifests) are put back, pointing at the unpacked copies,
# so each package's tests and examples are checked too.
#
# What this catches: a file outside the package (README, include_str!), a path-only or
# missing dependency, and a test or example that needs a feature its crate does not turn on by
# default (the README's workspace-wide --all-features build unifies features and hides it; it
# then needs `required-features`). cargo's own verification built each crate from scratch
# (7 min 50 s here, on top of 230 s of per-crate checks of the source tree, which this
# replaces); checking in the shared target dir compiles the dependencies once.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
export CARGO_TARGET_DIR=$TARGET
rm -rf "$TARGET/package"/idem-*.crate
cargo package --workspace --no-verify --quiet ${PACKAGE_ALLOW_DIRTY:+--allow-dirty}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The published crates (idem-repo-checks is publish = false: its tests read the repository).
names=$(cargo metadata --no-deps --format-version 1 | jq -r '.packages[] | select(.publish != []) | "\(.name)-\(.version)"')
members=() patches=()
for nv in $names; do
  # -m: files dated now, so no check is taken for fresh from an earlier run of this script (cargo
  # hashes path packages relative to the workspace root, and the archive keeps old dates).
  tar -xzmf "$TARGET/package/$nv.crate" -C "$scratch"
  # Back: the dev-dependencies the packaged manifest lost, at the unpacked copies.
  python3 - "$scratch" "$nv" "$names" <<'PY'
import sys, tomllib
scratch, nv, names = sys.argv[1], sys.argv[2], sys.argv[3].split()
dir_of = {n.rsplit("-", 1)[0]: n for n in names}
with open(f"{scratch}/{nv}/Cargo.toml.orig", "rb") as f:
    orig = tomllib.load(f)
out = []
for dep, spec in orig.get("dev-dependencies", {}).items():
    if not isinstance(spec, dict) or "path" not in spec or "version" in spec:
        continue
    out.append(f"\n[dev-dependencies.{dep}]")
    out.append(f'path = "../{dir_of[spec.get("package", dep)]}"')
    for k in ("package", "default-features", "features"):
        if k in spec:
            v = spec[k]
            out.append(f"{k} = " + ("true" if v is True else "false" if v is False else
                                    repr(v).replace("'", '"')))
if out:
    with open(f"{scratch}/{nv}/Cargo.toml", "a") as f:
        f.write("\n".join(out) + "\n")
PY
  members+=("\"$nv\"")
  patches+=("${nv%-*} = { path = \"$nv\" }")
done
{
  echo "[workspace]"
  echo "resolver = \"3\""
  echo "members = [$(IFS=,; echo "${members[*]}")]"
  echo
  echo "[patch.crates-io]"
  printf '%s\n' "${patches[@]}"
  echo
  # The workspace's profiles, so dependencies checked before are found again.
  sed -n '/^\[profile\./,$p' Cargo.toml
} >"$scratch/Cargo.toml"
cp Cargo.lock "$scratch/"
cd "$scratch"
cargo metadata --format-version 1 >/dev/null   # resolves once; the lock then differs from ours only if it had to
# (idem-repo-checks is not a member here, so its entry is expected to go.)
pairs() { awk '/^name = / { n = $3 } /^version = / && n != "\"idem-repo-checks\"" { print n, $3 }' "$1"; }
diff <(pairs "$OLDPWD/Cargo.lock") <(pairs Cargo.lock) || true
for nv in $names; do
  echo "[package-check] ${nv%-*}"
  # Warnings fail the step (the all-features clippy step cannot see default-feature code).
  cargo check -q -p "${nv%-*}" --tests --examples 2>&1 | tee "$scratch/check.log"
  ! grep -q '^warning' "$scratch/check.log" || { echo "[package-check] ${nv%-*}: warnings with its default features" >&2; exit 1; }
done
echo "[package-check] ok: $(wc -w <<<"$names") packaged crates compile on their own"
