#!/usr/bin/env bash
# Makes sure nats-server and redis-server are on this machine, and tmux (the tests run
# `spillway top` in a real terminal under it): installs them with apt where they are
# missing and apt is usable, otherwise says what to install.
set -u
missing=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/sbin/redis-server ] || missing+=(redis-server)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo -n"
if command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} with apt"
  if $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}"; then
    exit 0
  fi
fi
echo "spillway needs ${missing[*]}: install them (Debian/Ubuntu: apt-get install ${missing[*]};" \
  "macOS: brew install nats-server redis tmux) or point --nats-url/--redis-url at running" \
  "servers (tmux is for the tests only)." >&2
exit 1
