#!/usr/bin/env bash
# Install kilolined on a Debian 12 / Ubuntu 22.04+ host as a hardened systemd service.
#
#   sudo bash scripts/install.sh               # install or upgrade (idempotent), start, check it is up
#   sudo bash scripts/install.sh --no-start    # lay down the files only (image builds, tests)
#   sudo bash scripts/install.sh --uninstall   # remove the service and the venv (keeps the config)
#
# What it does: python3-venv from apt if missing, the static group `kiloline`, a venv in
# /opt/kiloline/venv with this package, /etc/kiloline/kiloline.yaml from the example (only if
# absent), a generated admin key and client keys (every ${NAME_KEY} the config needs) in
# /etc/kiloline/kiloline.env (each only if absent), the unit rendered
# from systemd/kilolined.service with the paths below, then enable + restart, and a non-zero exit
# with the journal's tail if the unit does not reach `active`.
#
# Who reads what: the unit runs as a DynamicUser (a uid allocated at start) with the static group
# `kiloline` as a supplementary group. /etc/kiloline is root:kiloline 0750 and every file directly
# in it (config, env file, a TLS key you put there) root:kiloline 0640: the service reads them,
# only root writes them. The venv is world-readable (umask 022 here, whatever the caller's).
#
# Overrides (absolute paths; the rendered unit uses them):
#   KILOLINE_PREFIX    /opt/kiloline                 the venv goes in $KILOLINE_PREFIX/venv
#   KILOLINE_ETC       /etc/kiloline                 kiloline.yaml and kiloline.env
#   KILOLINE_UNIT_DIR  /etc/systemd/system           where kilolined.service is written
#   KILOLINE_GROUP     kiloline                      the group that may read $KILOLINE_ETC
#   KILOLINE_PYTHON    python3 python3.13 …3.11      interpreters to try for the venv (>= 3.11)
# pip honours its own PIP_* variables (e.g. PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels offline).
set -euo pipefail
umask 022
PREFIX=${KILOLINE_PREFIX:-/opt/kiloline}
ETC=${KILOLINE_ETC:-/etc/kiloline}
UNIT_DIR=${KILOLINE_UNIT_DIR:-/etc/systemd/system}
GROUP=${KILOLINE_GROUP:-kiloline}
NAME=kilolined
UNIT=$UNIT_DIR/$NAME.service
DROP_IN_DIR=$UNIT_DIR/$NAME.service.d
SRC=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "install: $*" >&2; exit 1; }
warn() { echo "install: warning: $*" >&2; }

mode=install start=1
for arg in "$@"; do
  case $arg in
    --uninstall) mode=uninstall ;;
    --no-start) start=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

[[ $(id -u) -eq 0 ]] || die "run as root (sudo)"
# Paths go into a unit file verbatim: no spaces, no '%' (a systemd specifier), no relative paths.
for p in "$PREFIX" "$ETC" "$UNIT_DIR"; do
  [[ $p =~ ^/[A-Za-z0-9._/+-]+$ ]] || die "path '$p' must be absolute and use only [A-Za-z0-9._/+-]"
done
[[ $GROUP =~ ^[a-z_][a-z0-9_-]*$ ]] || die "group name '$GROUP' is not a valid system group name"

# The service's systemd is the one we talk to; without it only --no-start makes sense.
if (( start )) && [[ ! -d /run/systemd/system ]]; then
  die "systemd is not running as PID 1 here; use --no-start to only install the files"
fi

if [[ $mode == uninstall ]]; then
  if (( start )); then
    systemctl disable --now "$NAME" 2>/dev/null || true
  fi
  rm -f "$UNIT"
  rm -rf "$DROP_IN_DIR"
  if (( start )); then systemctl daemon-reload; fi
  # Only what install.sh made: KILOLINE_PREFIX may be a directory with other things in it.
  rm -rf "$PREFIX/venv"
  rmdir "$PREFIX" 2>/dev/null || true
  echo "$NAME removed; kept: $ETC (config and admin key), group $GROUP (owns it), /var/lib/kiloline (budget counters)"
  exit 0
fi

# Debian 12 and Ubuntu 24.04 have python3 >= 3.11; Ubuntu 22.04's python3 is 3.10, with
# python3.11 one apt install away.
PY=
for cand in ${KILOLINE_PYTHON:-python3 python3.13 python3.12 python3.11}; do
  if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    PY=$(command -v "$cand"); break
  fi
done
[[ -n $PY ]] || die "python >= 3.11 is needed: on Ubuntu 22.04, apt-get install python3.11 python3.11-venv"

getent group "$GROUP" >/dev/null || groupadd --system "$GROUP"

# The service must reach its files: every parent directory needs o+x for a uid that is in no group
# but $GROUP. PrivateTmp= and ProtectHome= hide /tmp, /var/tmp, /home, /root and /run/user from it.
reachable() {
  local d
  d=$(dirname "$1")
  while [[ $d != / ]]; do
    if [[ -d $d ]] && (( ( 8#$(stat -c %a "$d") & 1 ) == 0 )); then
      warn "$d is not world-searchable (o+x): the service cannot reach $1"
    fi
    d=$(dirname "$d")
  done
  case $1/ in
    /tmp/*|/var/tmp/*|/home/*|/root/*|/run/user/*)
      (( start )) && warn "$1 is hidden from the service (PrivateTmp=/ProtectHome=): it will not start" ;;
  esac
  return 0
}
reachable "$PREFIX"
reachable "$ETC"

# A service that keeps failing (a bad config, a port it cannot bind: Restart= starts it again
# every RestartSec) would be started while pip replaces the package under it, and die importing
# half an install: stopped first. A running one goes on serving from the code it loaded; the
# restart at the end brings the new one.
if (( start )) && [[ $(systemctl is-active "$NAME" 2>/dev/null || true) == activating ]]; then
  systemctl stop "$NAME" || true
fi

mkdir -p "$PREFIX"
# A venv without pip (python3-venv missing: Debian's python3 has no ensurepip) is made again.
if [[ ! -x $PREFIX/venv/bin/pip ]]; then
  rm -rf "$PREFIX/venv"
  if ! "$PY" -m venv "$PREFIX/venv" >/dev/null 2>&1; then
    rm -rf "$PREFIX/venv"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PY##*/}-venv"
    "$PY" -m venv "$PREFIX/venv"
  fi
fi
"$PREFIX/venv/bin/pip" install -q --disable-pip-version-check --upgrade "$SRC"
# The venv's python is a symlink to the interpreter it was made with (a pyenv one under /root
# would be out of the service's reach).
reachable "$(readlink -f "$PREFIX/venv/bin/python")"

mkdir -p "$ETC"
if [[ ! -f $ETC/kiloline.yaml ]]; then
  install -m 0640 -g "$GROUP" "$SRC/etc/kiloline.yaml" "$ETC/kiloline.yaml"
  echo "wrote $ETC/kiloline.yaml from the example: edit nodes, routes and keys"
fi
# Keys are never shipped: the admin key, and every key the config reads from a variable without
# a default (`key: ${ALICE_KEY}` in the example), get a random value in the env file once. So the
# service never starts with a key someone could guess, and a re-run keeps the keys it made.
wanted=()
if [[ ! -f $ETC/kiloline.env ]]; then
  (umask 077; : > "$ETC/kiloline.env")
  wanted+=(KILOLINE_ADMIN_KEY)
fi
while read -r var; do wanted+=("$var"); done \
  < <(grep -o '\${[A-Za-z_][A-Za-z0-9_]*_KEY}' "$ETC/kiloline.yaml" | sed 's/^\${//; s/}$//' | sort -u)
made=()
for var in "${wanted[@]}"; do
  grep -q "^$var=" "$ETC/kiloline.env" && continue
  value=$("$PREFIX/venv/bin/python" -c 'import secrets; print("kl_" + secrets.token_urlsafe(24))')
  printf '%s=%s\n' "$var" "$value" >> "$ETC/kiloline.env"
  if [[ $var == KILOLINE_ADMIN_KEY ]]; then
    echo "admin key (also in $ETC/kiloline.env): $value"
  else
    made+=("$var")
  fi
done
if (( ${#made[@]} )); then
  echo "generated into $ETC/kiloline.env (hand them to your clients): ${made[*]}"
fi
# The job callbacks' signing secret, when the config reads it from the environment (the example
# does): a random one, so an installed gateway signs its callbacks with a secret nobody else has.
if grep -q '\${KILOLINE_WEBHOOK_SECRET[:}]' "$ETC/kiloline.yaml" && ! grep -q '^KILOLINE_WEBHOOK_SECRET=' "$ETC/kiloline.env"; then
  printf 'KILOLINE_WEBHOOK_SECRET=%s\n' "$("$PREFIX/venv/bin/kilolined" keygen --whsec)" >> "$ETC/kiloline.env"
  echo "generated into $ETC/kiloline.env (give it to your webhook receivers): KILOLINE_WEBHOOK_SECRET"
fi
# Every run, not only the first: an upgrade from an older install (root:root 0750, which the
# dynamic user could not read) and a file copied in with root's umask are fixed here.
chown root:"$GROUP" "$ETC"
chmod 0750 "$ETC"
find "$ETC" -maxdepth 1 -type f -exec chown root:"$GROUP" {} + -exec chmod 0640 {} +

# The unit, rendered from the template: its default paths replaced by ours in one pass, so a
# prefix that happens to contain the other default is not rewritten twice.
render() {
  "$PY" - "$1" "$PREFIX" "$ETC" "$GROUP" <<'EOF'
import re, sys
template, prefix, etc, group = sys.argv[1:]
text = open(template, encoding="utf-8").read()
paths = {"/opt/kiloline": prefix, "/etc/kiloline": etc}
text = re.sub(r"/opt/kiloline(?![\w-])|/etc/kiloline(?![\w-])", lambda m: paths[m.group()], text)
text = re.sub(r"(?m)^SupplementaryGroups=.*$", "SupplementaryGroups=" + group, text)
sys.stdout.write(text)
EOF
}
mkdir -p "$UNIT_DIR"
tmp=$(mktemp "$UNIT_DIR/.$NAME.service.XXXXXX")
trap 'rm -f "$tmp"' EXIT
render "$SRC/systemd/kilolined.service" > "$tmp"
grep -qx "ExecStart=$PREFIX/venv/bin/kilolined .* -c $ETC/kiloline.yaml" "$tmp" || die "rendering the unit failed"
chmod 0644 "$tmp"
mv -f "$tmp" "$UNIT"

ver=$(systemctl --version 2>/dev/null | awk 'NR==1 {print $2}' || true)
if [[ $ver =~ ^[0-9]+$ ]] && (( ver >= 253 )); then
  mkdir -p "$DROP_IN_DIR"
  install -m 0644 "$SRC/systemd/notify-reload.conf" "$DROP_IN_DIR/notify-reload.conf"
else
  rm -f "$DROP_IN_DIR/notify-reload.conf"
  rmdir "$DROP_IN_DIR" 2>/dev/null || true
fi

# The environment the unit gets: the env file (systemd reads it as root and passes it on) and
# STATE_DIRECTORY from StateDirectory=kiloline.
# shellcheck source=/dev/null
( set -a; . "$ETC/kiloline.env"; set +a; export STATE_DIRECTORY=/var/lib/kiloline
  exec "$PREFIX/venv/bin/kilolined" check -c "$ETC/kiloline.yaml" ) \
  || die "fix $ETC/kiloline.yaml, then run this again"

if (( ! start )); then
  echo "installed (not started): $UNIT"
  exit 0
fi

systemctl daemon-reload
systemctl enable --quiet "$NAME"
# A unit that failed (a bad config, then Restart= until the start limit) would refuse the restart.
systemctl reset-failed "$NAME" 2>/dev/null || true
# Type=notify: restart returns once the daemon said READY=1, or fails when it exits or times out.
# The second look catches a daemon that dies right after saying it was ready.
if ! systemctl restart "$NAME" || ! sleep 1 || ! systemctl is-active --quiet "$NAME"; then
  echo "install: $NAME did not reach 'active':" >&2
  systemctl status --no-pager --lines=0 "$NAME" >&2 || true
  journalctl -u "$NAME" -n 40 --no-pager -o short-monotonic >&2 || true
  exit 1
fi
echo "$NAME is active: systemctl status $NAME · journalctl -u $NAME -f"
echo "status:    KILOLINE_ADMIN_KEY=… $PREFIX/venv/bin/kilolined status"
