#!/usr/bin/env bash
# Install kilolined on a fresh Debian/Ubuntu VPS as a hardened systemd service.
#
#   sudo bash scripts/install.sh              # install or upgrade (idempotent)
#   sudo bash scripts/install.sh --uninstall  # remove the service and the venv (keeps /etc/kiloline)
#
# What it does: python3-venv from apt, a venv in /opt/kiloline/venv with this package, the unit
# in /etc/systemd/system, /etc/kiloline/kiloline.yaml from the example (only if absent), a
# generated admin key in /etc/kiloline/kiloline.env (only if absent), then enable + start.
set -euo pipefail
PREFIX=${KILOLINE_PREFIX:-/opt/kiloline}
ETC=${KILOLINE_ETC:-/etc/kiloline}
UNIT=/etc/systemd/system/kilolined.service
SRC=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "install: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (sudo)"

if [[ ${1:-} == "--uninstall" ]]; then
  systemctl disable --now kilolined 2>/dev/null || true
  rm -f "$UNIT"
  rm -rf /etc/systemd/system/kilolined.service.d
  systemctl daemon-reload 2>/dev/null || true
  rm -rf "$PREFIX"
  echo "kilolined removed; config kept in $ETC (delete it yourself if you want), state in /var/lib/kiloline"
  exit 0
fi

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  die "python3 >= 3.11 is needed (Debian 12 / Ubuntu 24.04 have it)"
fi
if ! python3 -m venv --help >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi

mkdir -p "$PREFIX"
[[ -x $PREFIX/venv/bin/python ]] || python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --disable-pip-version-check --upgrade "$SRC"

mkdir -p "$ETC"
chmod 0750 "$ETC"
if [[ ! -f $ETC/kiloline.yaml ]]; then
  cp "$SRC/etc/kiloline.yaml" "$ETC/kiloline.yaml"
  echo "wrote $ETC/kiloline.yaml from the example: edit nodes, routes and keys"
fi
if [[ ! -f $ETC/kiloline.env ]]; then
  admin=$("$PREFIX/venv/bin/python" -c 'import secrets; print("kl_" + secrets.token_urlsafe(24))')
  umask 077
  printf 'KILOLINE_ADMIN_KEY=%s\n' "$admin" > "$ETC/kiloline.env"
  echo "admin key (also in $ETC/kiloline.env): $admin"
fi

install -m 0644 "$SRC/systemd/kilolined.service" "$UNIT"
ver=$(systemctl --version 2>/dev/null | awk 'NR==1 {print $2}')
if [[ -n $ver && $ver -ge 253 ]]; then
  mkdir -p /etc/systemd/system/kilolined.service.d
  install -m 0644 "$SRC/systemd/notify-reload.conf" /etc/systemd/system/kilolined.service.d/notify-reload.conf
fi

set -a; . "$ETC/kiloline.env"; set +a
"$PREFIX/venv/bin/kilolined" check -c "$ETC/kiloline.yaml" || die "fix $ETC/kiloline.yaml, then run this again"

systemctl daemon-reload
systemctl enable kilolined >/dev/null
systemctl restart kilolined
echo "kilolined is running: systemctl status kilolined · journalctl -u kilolined -f"
echo "status:    KILOLINE_ADMIN_KEY=… $PREFIX/venv/bin/kilolined status"
