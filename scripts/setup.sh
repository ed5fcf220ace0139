#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (as root) for stacklens: Debian's BCC and kernel headers,
# tracefs, and a virtualenv at .venv with stacklens and its test dependencies.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
dpkg -s python3-bpfcc >/dev/null 2>&1 || need_apt+=(python3-bpfcc)
dpkg -s linux-headers-amd64 >/dev/null 2>&1 || need_apt+=(linux-headers-amd64)
for p in tmux prometheus golang-go; do dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p"); done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# BCC compiles against headers at /lib/modules/$(uname -r)/build; Debian ships 6.1's.
kdir=/lib/modules/$(uname -r)
if [ ! -e "$kdir/build" ]; then
  hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
  mkdir -p "$kdir"
  ln -sfn "$hdr" "$kdir/build"
  ln -sfn "$common" "$kdir/source"
  echo "setup: linked $hdr into $kdir"
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Debian's bcc is pure Python over libbcc.so; expose only that package to the venv.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p .venv/debian-bcc
ln -sfn /usr/lib/python3/dist-packages/bcc .venv/debian-bcc/bcc
echo "$(pwd)/.venv/debian-bcc" > "$site/debian_bcc.pth"

.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0 numpy  # numpy: torch warns without it
.venv/bin/python -m pip install -q -e '.[test]'
# py-spy: the profiler tests/bpf/test_pprof_pyspy.py compares stacklens' pprof with.
.venv/bin/python -m pip install -q py-spy==0.4.3
# speedscope's published file-format schema (from its npm package) for the export tests.
ss=.venv/share/speedscope/file-format-schema.json
if [ ! -s "$ss" ] && command -v npm >/dev/null; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && npm pack speedscope@1.25.0 --silent >/dev/null 2>&1 && tar xzf speedscope-1.25.0.tgz package/dist/release/file-format-schema.json); then
    mkdir -p "$(dirname "$ss")" && cp "$tmp/package/dist/release/file-format-schema.json" "$ss"
  else
    echo "setup: could not fetch speedscope's schema from npm (the test that needs it will skip)"
  fi
  rm -rf "$tmp"
fi

# The unit's ExecStart and users' shells find the commands here; the daemon's config and group.
ln -sfn "$(pwd)/.venv/bin/stacklensd" /usr/local/bin/stacklensd
ln -sfn "$(pwd)/.venv/bin/stacklens" /usr/local/bin/stacklens
mkdir -p /etc/stacklens
[ -f /etc/stacklens/stacklensd.toml ] || install -m 0644 systemd/stacklensd.toml /etc/stacklens/stacklensd.toml
getent group stacklens >/dev/null || groupadd --system stacklens
.venv/bin/python -c 'import bcc, torch, jax, stacklens, grpc_health.v1.health, grpc_reflection.v1alpha.reflection; print("setup: ok (bcc", bcc.__version__ if hasattr(bcc, "__version__") else "", ", torch", torch.__version__, ", jax", jax.__version__, ")")'
