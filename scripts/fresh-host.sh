#!/usr/bin/env bash
# Make a used machine look fresh where it matters to the test suite, and put it back afterwards (issue 24).
#
#   scripts/fresh-host.sh begin STATE   # note the swap that is on, then turn it off
#   scripts/fresh-host.sh end STATE     # turn off swap made meanwhile, turn the noted swap back on
#
# A fresh Debian machine has no swap; a developers' machine often has the zram swap a node or an earlier run
# made. Tests must pass on the fresh one (the node sets up the swap it needs: SHOAL_ZRAM_SWAP=auto), so
# .ci/run turns swap off before the suite — a green CI then means a green fresh machine — and restores it.
# Without root it does nothing. Needs only bash, swapon/swapoff and /proc/swaps (it runs before `make setup`).
set -uo pipefail

cmd=${1:-}
state=${2:-}
if [[ -z "$cmd" || -z "$state" ]]; then
    echo "usage: $0 begin|end STATE_FILE" >&2
    exit 2
fi
if [[ $EUID -ne 0 ]]; then
    echo "fresh-host: not root, leaving swap as it is" >&2
    exit 0
fi
marker=/run/shoal/zram-swap.json

active() {  # "device priority" of every swap area that is on
    tail -n +2 /proc/swaps | awk '{print $1, $5}'
}

case "$cmd" in
begin)
    active >"$state"
    [[ -f $marker ]] && cp "$marker" "$state.marker"
    while read -r dev prio; do
        [[ -z "$dev" ]] && continue
        echo "fresh-host: swap $dev (priority $prio) off for the suite (back on afterwards)" >&2
        swapoff "$dev" || echo "fresh-host: could not turn $dev off: the suite runs with it" >&2
    done <"$state"
    ;;
end)
    [[ -f "$state" ]] || { echo "fresh-host: no state file $state" >&2; exit 1; }
    # swap turned on during the suite and still on (a node's zram the suite's end did not remove)
    while read -r dev _; do
        [[ -z "$dev" ]] && continue
        if ! grep -q "^$dev " "$state"; then
            echo "fresh-host: turning off $dev, made during the suite" >&2
            swapoff "$dev" || true
            if [[ $dev == /dev/zram* ]]; then
                echo 1 >"/sys/block/${dev#/dev/}/reset" 2>/dev/null || true
            fi
        fi
    done < <(active)
    while read -r dev prio; do
        [[ -z "$dev" ]] && continue
        if ! active | grep -q "^$dev "; then
            swapon -p "$prio" "$dev" && echo "fresh-host: swap $dev back on" >&2 \
                || echo "fresh-host: could not turn $dev back on" >&2
        fi
    done <"$state"
    if [[ -f "$state.marker" ]]; then
        cp "$state.marker" "$marker"
        rm -f "$state.marker"
    fi
    ;;
*)
    echo "usage: $0 begin|end STATE_FILE" >&2
    exit 2
    ;;
esac
exit 0
