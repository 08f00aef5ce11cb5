#!/usr/bin/env bash
# Boot test: scripts/install.sh under a real systemd (Debian 12, systemd 252) as PID 1.
#
#   sudo bash scripts/boot_test.sh
#
# A Debian 12 rootfs from `debootstrap --variant=minbase` (cached in $KILOLINE_CI_CACHE, default
# /var/cache/kiloline-ci, so a re-run takes about a minute) boots in `systemd-nspawn -b` with a
# throw-away overlay (the cached tree is never written) and no network but its own loopback: the
# example config's nodes are unreachable by construction. Commands go in through `nsenter`; pip
# inside installs offline from a wheelhouse built here.
#
# The flow: install.sh → unit active → GET /healthz 200 → an edit + `systemctl reload` applied by
# the SIGHUP path → install.sh on a config that cannot start (port 80, no capability) exits non-zero
# with the journal → fixed, install.sh again (idempotent, same admin key) → `systemctl stop` clean
# (exit 0, Result=success) → install.sh --uninstall.
#
# Needs root, systemd-nspawn (systemd-container), debootstrap, and Debian's mirror through apt's
# usual sources (override with KILOLINE_DEBIAN_MIRROR). Exits non-zero on any failed step.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KILOLINE_CI_CACHE:-/var/cache/kiloline-ci}
SUITE=bookworm
# procps for ExecReload=/bin/kill; dbus because a real Debian 12 server has it.
PACKAGES=systemd,systemd-sysv,dbus,procps,python3,python3-venv
NAME=kilolined
T0=$SECONDS

PASSED=0
say() { printf '[boot-test %3ds] %s\n' $((SECONDS - T0)) "$*"; }
ok() { PASSED=$((PASSED + 1)); say "ok: $*"; }
fail() { say "FAIL: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || fail "run as root"
for tool in systemd-nspawn debootstrap nsenter flock; do
  command -v "$tool" >/dev/null || fail "$tool not found (apt-get install systemd-container debootstrap)"
done

# Debian's mirror as apt here knows it (deb822 .sources or a one-line sources.list), else the default.
mirror() {
  if [[ -n ${KILOLINE_DEBIAN_MIRROR:-} ]]; then echo "$KILOLINE_DEBIAN_MIRROR"; return; fi
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    uri=$(awk -v s="$SUITE" '
      /^URIs:/ {u=$2} /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == s) ok=1}
      /^$/ {if (ok && u) exit; u=""; ok=0} END {if (ok && u) print u}' "$f")
    if [[ -n $uri ]]; then echo "$uri"; return; fi
  done
  uri=$(awk -v s="$SUITE" '$1 == "deb" && $0 ~ " " s " " {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
        /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# --- the cached rootfs ------------------------------------------------------------------------------
mkdir -p "$CACHE"
key=$(printf '%s %s minbase v1' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12)
ROOTFS=$CACHE/rootfs-$SUITE-$key
exec 9>"$CACHE/.lock"
flock 9
if [[ ! -x $ROOTFS/usr/lib/systemd/systemd ]]; then
  MIRROR=$(mirror)
  say "building $ROOTFS from $MIRROR (once; a few minutes)"
  rm -rf "$ROOTFS.tmp"
  if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS.tmp" "$MIRROR" \
       > "$CACHE/debootstrap.log" 2>&1; then
    tail -n 20 "$CACHE/debootstrap.log" >&2
    fail "debootstrap from $MIRROR failed (log: $CACHE/debootstrap.log; set KILOLINE_DEBIAN_MIRROR)"
  fi
  chroot "$ROOTFS.tmp" apt-get clean
  echo kiloline-boot > "$ROOTFS.tmp/etc/hostname"
  : > "$ROOTFS.tmp/etc/machine-id"   # systemd makes a transient one at each boot
  mv "$ROOTFS.tmp" "$ROOTFS"
  for old in "$CACHE"/rootfs-*; do [[ $old == "$ROOTFS" ]] || rm -rf "$old"; done
fi
flock -u 9

# --- this run: a copy of the source, a wheelhouse --------------------------------------------------
WORK=$(mktemp -d "$CACHE/run.XXXXXX")
NSPAWN_PID=
cleanup() {
  local rc=$?
  if [[ -n $NSPAWN_PID ]] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
    if (( rc != 0 )) && [[ -n ${LEADER:-} ]]; then
      say "container journal (last 60 lines):" >&2
      in_ct journalctl -n 60 --no-pager >&2 || true
    fi
    kill -TERM "$NSPAWN_PID" 2>/dev/null || true   # nspawn shuts the container down cleanly
    for _ in $(seq 150); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$NSPAWN_PID" 2>/dev/null || true
    wait "$NSPAWN_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
  say "done in $((SECONDS - T0)) s"
  # The plain closing line CI reads: every check above is one.
  if (( rc == 0 )); then echo "boot-test: $PASSED passed, 0 failed"; else echo "boot-test: $PASSED passed, 1 failed"; fi
}
trap cleanup EXIT

mkdir -p "$WORK/src" "$CACHE/wheelhouse"
tar -C "$SRC" --exclude=./.git --exclude=./.venv --exclude=./dist --exclude=./build --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -cf - . | tar -C "$WORK/src" -xf -
HOST_PY=$SRC/.venv/bin/python
[[ -x $HOST_PY ]] || HOST_PY=python3
want=$(chroot "$ROOTFS" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
have=$("$HOST_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $want == "$have" ]] || fail "the wheelhouse needs Python $want here (have $have): set up .venv with python$want"
say "wheelhouse (the dependencies, and setuptools for building the project inside)"
"$HOST_PY" -m pip wheel -q --disable-pip-version-check -w "$CACHE/wheelhouse" --find-links "$CACHE/wheelhouse" \
  "$WORK/src" setuptools wheel 2>&1 | grep -v '^WARNING: Location' >&2 || true
rm -f "$CACHE"/wheelhouse/kilolined-*.whl
rm -rf "$WORK/src/build" "$WORK"/src/*.egg-info

# --- boot --------------------------------------------------------------------------------------------
say "booting $SUITE (systemd-nspawn -b, volatile overlay, private network)"
systemd-nspawn --quiet --register=no --keep-unit --boot --directory="$ROOTFS" --volatile=overlay \
  --private-network --machine="kl-boot-$$" --console=read-only \
  --bind="$WORK/src:/src" --bind-ro="$CACHE/wheelhouse:/wheels" > "$WORK/console.log" 2>&1 &
NSPAWN_PID=$!
# The leader is nspawn's child once it runs systemd (before that it may be nspawn's own helper).
LEADER=
for _ in $(seq 300); do
  kill -0 "$NSPAWN_PID" 2>/dev/null || { cat "$WORK/console.log" >&2; fail "systemd-nspawn exited"; }
  for child in $(ps -o pid= --ppid "$NSPAWN_PID"); do
    [[ $(cat "/proc/$child/comm" 2>/dev/null) == systemd ]] && LEADER=$child
  done
  [[ -n $LEADER ]] && break
  sleep 0.1
done
[[ -n $LEADER ]] || { cat "$WORK/console.log" >&2; fail "no systemd in the container after 30 s"; }

in_ct() {
  nsenter --target "$LEADER" --all env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 HOME=/root TERM=dumb SYSTEMD_PAGER= SYSTEMD_COLORS=0 "$@"
}
# A GET inside the container (its network is its own); prints the status line and the body.
http_get() {
  in_ct python3 -c '
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]} if len(sys.argv) > 2 else {})
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
except OSError as e:
    print(0); print(e)
' "$@"
}
json_get() { python3 -c 'import json, sys; d = json.load(sys.stdin)
for k in sys.argv[1].split("."): d = d[k]
print(d)' "$1"; }

# Until PID 1 listens on its private socket, systemctl cannot even ask; then it waits for the boot.
state=
for _ in $(seq 90); do
  state=$(timeout 90 nsenter --target "$LEADER" --all systemctl is-system-running --wait 2>/dev/null || true)
  case $state in running|degraded|maintenance|stopping) break ;; esac
  sleep 1
done
case $state in
  running) ;;
  degraded) say "booted degraded: $(in_ct systemctl --failed --no-legend --plain | awk '{print $1}' | xargs)" ;;
  *) cat "$WORK/console.log" >&2; fail "boot did not finish (state: ${state:-none})" ;;
esac
ok "booted: $(in_ct systemctl --version | head -n1)"

# --- install ------------------------------------------------------------------------------------------
install_ct() { in_ct env PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels bash /src/scripts/install.sh "$@"; }
say "install.sh"
install_ct > "$WORK/install1.log" 2>&1 || { cat "$WORK/install1.log" >&2; fail "install.sh failed"; }
sed 's/^/    /' "$WORK/install1.log" | grep -v 'admin key'
[[ $(in_ct systemctl is-active "$NAME") == active ]] || fail "$NAME is not active after install.sh"
pid=$(in_ct systemctl show -p MainPID --value "$NAME")
# shellcheck disable=SC2016  # awk's own $1, $2
ids=$(in_ct awk '/^(Uid|Gid|Groups):/ {printf "%s %s ", $1, $2}' "/proc/$pid/status")
ok "$NAME active: pid $pid, ${ids}(a dynamic uid; gid $(in_ct getent group kiloline | cut -d: -f3) is kiloline)"

KEY=$(in_ct sed -n 's/^KILOLINE_ADMIN_KEY=//p' /etc/kiloline/kiloline.env)
out=$(http_get http://127.0.0.1:8080/healthz)
[[ $(head -n1 <<<"$out") == 200 ]] || fail "/healthz: $out"
ok "GET /healthz: 200"
out=$(http_get http://127.0.0.1:8080/admin/state "$KEY")
[[ $(head -n1 <<<"$out") == 200 ]] || fail "/admin/state with the generated admin key: $out"

# --- reload -------------------------------------------------------------------------------------------
# The config watcher applies an edit too, within ~50 ms. So that the reload is what applies it,
# the daemon is paused (SIGSTOP) while the file changes and `systemctl reload` sends its SIGHUP:
# on SIGCONT the signal is handled at once, the watcher's event only after its debounce step.
# A try the watcher still won is made again with another value.
pid=$(in_ct systemctl show -p MainPID --value "$NAME")
via_sighup=
for slots in 3 5 6; do
  before=$(in_ct journalctl -u "$NAME" -o cat --no-pager | grep -c 'applied (SIGHUP)' || true)
  in_ct sh -c "kill -STOP $pid
    sed -i 's/^\(    max_concurrency: \)[0-9]*\(  *# [0-9]* voices\)/\1$slots\2/' /etc/kiloline/kiloline.yaml
    timeout 30 systemctl reload $NAME; rc=\$?
    kill -CONT $pid; exit \$rc" || fail "systemctl reload failed"
  for _ in $(seq 100); do
    now=$(http_get http://127.0.0.1:8080/admin/state "$KEY" | tail -n +2 | json_get routes.tts.max_concurrency || true)
    [[ $now == "$slots" ]] && break
    sleep 0.1
  done
  [[ $now == "$slots" ]] || fail "routes.tts.max_concurrency is '$now' after the reload, not $slots"
  sleep 0.5   # the log line follows the state
  after=$(in_ct journalctl -u "$NAME" -o cat --no-pager | grep -c 'applied (SIGHUP)' || true)
  if (( after > before )); then via_sighup=$slots; break; fi
  say "the watcher applied max_concurrency=$slots before SIGHUP did; again"
done
[[ -n $via_sighup ]] || fail "no reload was applied by SIGHUP"
[[ $(in_ct systemctl show -p MainPID --value "$NAME") == "$pid" ]] || fail "reload restarted the process"
[[ $(in_ct stat -c '%a %U:%G' /etc/kiloline/kiloline.yaml) == "640 root:kiloline" ]] || fail "the edit changed the mode"
ok "systemctl reload: routes.tts.max_concurrency=$via_sighup applied (SIGHUP), same pid $pid"

# --- a unit that cannot start makes install.sh fail loudly ---------------------------------------------
in_ct sed -i 's/^  listen: "0.0.0.0:8080"/  listen: "0.0.0.0:80"/' /etc/kiloline/kiloline.yaml
if install_ct > "$WORK/install2.log" 2>&1; then
  cat "$WORK/install2.log" >&2; fail "install.sh exited 0 with a unit that cannot bind port 80"
fi
grep -q "did not reach 'active'" "$WORK/install2.log" || { cat "$WORK/install2.log" >&2; fail "no failure message"; }
grep -q "$NAME\[[0-9]*\]:" "$WORK/install2.log" || { cat "$WORK/install2.log" >&2; fail "no journal tail"; }
ok "install.sh on a config that cannot bind :80 exits non-zero, with the journal:"
grep "$NAME\[[0-9]*\]:" "$WORK/install2.log" | tail -n 3 | sed 's/^/    /'

in_ct sed -i 's/^  listen: "0.0.0.0:80"/  listen: "0.0.0.0:8080"/' /etc/kiloline/kiloline.yaml
mark=$(in_ct journalctl -u "$NAME" -o cat --no-pager | wc -l)
install_ct > "$WORK/install3.log" 2>&1 || { cat "$WORK/install3.log" >&2; fail "install.sh after the fix failed"; }
[[ $(in_ct systemctl is-active "$NAME") == active ]] || fail "$NAME is not active after the second install"
[[ $(in_ct sed -n 's/^KILOLINE_ADMIN_KEY=//p' /etc/kiloline/kiloline.env) == "$KEY" ]] || fail "the admin key changed"
[[ $(http_get http://127.0.0.1:8080/healthz | head -n1) == 200 ]] || fail "/healthz after the second install"
ok "fixed, install.sh again: active, same admin key, /healthz 200"

# --- stop ----------------------------------------------------------------------------------------------
in_ct systemctl stop "$NAME"
shown=$(in_ct systemctl show -p ActiveState,Result,ExecMainCode,ExecMainStatus "$NAME" | sort | xargs)
[[ $shown == "ActiveState=inactive ExecMainCode=1 ExecMainStatus=0 Result=success" ]] || fail "stop: $shown"
tail_log=$(in_ct journalctl -u "$NAME" -o cat --no-pager | tail -n +$((mark + 1)))
if grep -q Traceback <<<"$tail_log"; then echo "$tail_log" >&2; fail "a traceback in the journal"; fi
ok "systemctl stop: $shown"

install_ct --uninstall > "$WORK/uninstall.log" 2>&1 || { cat "$WORK/uninstall.log" >&2; fail "--uninstall failed"; }
in_ct test ! -e /etc/systemd/system/$NAME.service || fail "--uninstall left the unit"
in_ct test -f /etc/kiloline/kiloline.yaml || fail "--uninstall removed the config"
ok "install.sh --uninstall: unit and venv gone, config kept"
