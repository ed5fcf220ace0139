#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (as root) for stacklens: Debian's BCC and kernel headers,
# tracefs, and a virtualenv at .venv with stacklens and its test dependencies. The commands are
# .venv/bin/stacklens and .venv/bin/stacklensd of this clone.
# Idempotent: a second run only checks.
#
#   bash scripts/setup.sh [--install-links]      (or STACKLENS_LINK=1)
#
# Outside the clone it changes only what every clone needs alike (Debian packages, the kernel
# headers' link, tracefs). --install-links also makes this clone the machine's stacklens, for the
# systemd unit and users' PATH: /usr/local/bin/stacklens{,d} link to this clone's .venv (each line
# says what a link pointed at before), /etc/stacklens/stacklensd.toml (if missing), the docs the
# unit names in /usr/share/doc/stacklens, and the group stacklens. DESTDIR=DIR puts those under DIR.
#
# Python: the package runs on >= 3.10 (pyproject.toml); this set-up needs >= 3.11, for its test
# dependencies (jax 0.10.2, numpy, scipy). It uses $PYTHON if set, else python3, else Debian's
# /usr/bin/python3 when python3 is older.
set -euo pipefail

SETUP_MIN_PYTHON=3.11
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
INSTALL_LINKS=${STACKLENS_LINK:-0}

parse_args() {
  local a
  for a in "$@"; do
    case "$a" in
      --install-links) INSTALL_LINKS=1 ;;
      -h|--help) sed -n '2,17s/^# \{0,1\}//p' "$ROOT/scripts/setup.sh"; exit 0 ;;
      *) echo "setup: unknown argument $a (known: --install-links)" >&2; exit 64 ;;
    esac
  done
}

# "3.11" of interpreter $1; empty when it does not run
py_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# true when version $1 >= SETUP_MIN_PYTHON
py_new_enough() {
  [ -n "$1" ] && [ "$(printf '%s\n%s\n' "$SETUP_MIN_PYTHON" "$1" | sort -V | head -1)" = "$SETUP_MIN_PYTHON" ]
}

# The interpreter for .venv, on stdout; what it skipped and why on stderr; exit 1 when none fits.
pick_python() {
  local v
  if [ -n "${PYTHON:-}" ]; then
    v=$(py_version "$PYTHON")
    if py_new_enough "$v"; then echo "$PYTHON"; return 0; fi
    echo "setup: PYTHON=$PYTHON is Python ${v:-that does not run}; this set-up needs >= $SETUP_MIN_PYTHON" \
         "(its test dependencies: jax 0.10.2, numpy, scipy). Point PYTHON at Python >= $SETUP_MIN_PYTHON" \
         "(Debian 12's /usr/bin/python3), or install the package alone: pip install . (Python >= 3.10)." >&2
    return 1
  fi
  v=$(py_version python3)
  if py_new_enough "$v"; then echo python3; return 0; fi
  local debian=/usr/bin/python3 dv
  dv=$(py_version "$debian")
  if py_new_enough "$dv"; then
    echo "setup: python3 on PATH is ${v:-missing}; this set-up needs >= $SETUP_MIN_PYTHON: using $debian ($dv)" >&2
    echo "$debian"; return 0
  fi
  echo "setup: python3 is ${v:-missing} and $debian is ${dv:-missing}; this set-up needs Python >= $SETUP_MIN_PYTHON" \
       "(its test dependencies: jax 0.10.2, numpy, scipy): apt-get install python3 on Debian 12, or set" \
       "PYTHON=/path/to/python3.11+. The package alone runs on >= 3.10: pip install ." >&2
  return 1
}

setup_machine() {
  local need_apt=() p
  dpkg -s python3-bpfcc >/dev/null 2>&1 || need_apt+=(python3-bpfcc)
  dpkg -s linux-headers-amd64 >/dev/null 2>&1 || need_apt+=(linux-headers-amd64)
  for p in tmux prometheus golang-go jq; do dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p"); done
  if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi

  # BCC compiles against headers at /lib/modules/$(uname -r)/build; Debian ships 6.1's.
  local kdir hdr common
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
}

setup_venv() {
  local py v site
  if [ -x .venv/bin/python ]; then
    v=$(py_version .venv/bin/python)
    if ! py_new_enough "$v"; then
      echo "setup: .venv has Python ${v:-that does not run}; this set-up needs >= $SETUP_MIN_PYTHON: remove .venv and run again" >&2
      exit 1
    fi
  else
    py=$(pick_python) || exit 1
    "$py" -m venv .venv
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
  local ss=.venv/share/speedscope/file-format-schema.json tmp
  if [ ! -s "$ss" ] && command -v npm >/dev/null; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && npm pack speedscope@1.25.0 --silent >/dev/null 2>&1 && tar xzf speedscope-1.25.0.tgz package/dist/release/file-format-schema.json); then
      mkdir -p "$(dirname "$ss")" && cp "$tmp/package/dist/release/file-format-schema.json" "$ss"
    else
      echo "setup: could not fetch speedscope's schema from npm (the test that needs it will skip)"
    fi
    rm -rf "$tmp"
  fi
}

# ln -sfn $1 $2, saying what $2 was before
link_cmd() {
  local target=$1 link=$2 was
  was=$(readlink "$link" 2>/dev/null || true)
  if [ "$was" = "$target" ]; then
    echo "setup: $link -> $target (unchanged)"
    return
  fi
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "setup: $link exists and is not a link: left as it is (remove it and run again)" >&2
    return 1
  fi
  mkdir -p "$(dirname "$link")"
  ln -sfn "$target" "$link"
  echo "setup: $link -> $target${was:+ (was -> $was)}"
}

# The machine-wide install of this clone (--install-links); otherwise says what it leaves alone.
install_system() {
  local bin=${DESTDIR:-}/usr/local/bin etc=${DESTDIR:-}/etc/stacklens doc=${DESTDIR:-}/usr/share/doc/stacklens c was
  if [ "$INSTALL_LINKS" != 1 ]; then
    for c in stacklens stacklensd; do
      was=$(readlink "$bin/$c" 2>/dev/null || true)
      if [ -n "$was" ] && [ "$was" != "$ROOT/.venv/bin/$c" ]; then
        echo "setup: $bin/$c links to another clone ($was), left as it is; this clone's: .venv/bin/$c"
      fi
    done
    echo "setup: nothing installed outside this clone (commands: .venv/bin/stacklens{,d});" \
         "bash scripts/setup.sh --install-links makes this clone the one in $bin and the systemd unit's"
    return 0
  fi
  for c in stacklens stacklensd; do
    link_cmd "$ROOT/.venv/bin/$c" "$bin/$c"
  done
  mkdir -p "$etc"
  if [ -f "$etc/stacklensd.toml" ]; then
    echo "setup: $etc/stacklensd.toml exists, left as it is"
  else
    install -m 0644 "$ROOT/systemd/stacklensd.toml" "$etc/stacklensd.toml"
    echo "setup: installed $etc/stacklensd.toml"
  fi
  # the files the unit's Documentation= names
  install -D -m 0644 "$ROOT/README.md" "$doc/README.md"
  install -D -m 0644 "$ROOT/systemd/README.md" "$doc/systemd.md"
  echo "setup: installed $doc/README.md and $doc/systemd.md"
  if [ -z "${DESTDIR:-}" ] && ! getent group stacklens >/dev/null; then
    groupadd --system stacklens
    echo "setup: created the group stacklens (members may use stacklensd's socket)"
  fi
}

main() {
  parse_args "$@"
  cd "$ROOT"
  setup_machine
  setup_venv
  install_system
  .venv/bin/python -c 'import bcc, torch, jax, stacklens, grpc_health.v1.health, grpc_reflection.v1alpha.reflection; print("setup: ok (bcc", bcc.__version__ if hasattr(bcc, "__version__") else "", ", torch", torch.__version__, ", jax", jax.__version__, ")")'
}

# sourced (tests/unit/test_install_setup.py): the functions only
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
