#!/bin/sh
# Starts gpu-agent for scripts/gpu-check in a host root of its own.
#
# Usage: sandbox.sh MODE ROOT SRC LOG -- COMMAND...
#   bind  (run in a private mount namespace: `unshare --mount`) the host's
#         read-only parts (SRC/sys, proc, dev, usr, etc, opt, lib*, bin,
#         sbin) are bind-mounted read-only under ROOT, beside ROOT's own
#         writable run/ and var/ (the kubelet's device-plugins directory,
#         the agent's state and lock, the validation files). Whatever the
#         agent writes lands in ROOT; a write into a bound part fails on the
#         read-only mount. The mounts end with the namespace.
#   none  ROOT is already a private copy (a fixture host): nothing to mount.
# Then it prints "ready", waits for one line on stdin (gpu-check starts its
# clock when it sends it) and replaces itself by COMMAND, whose output goes
# to LOG.
set -eu
mode=$1 root=$2 src=$3 log=$4
shift 4
[ "${1:-}" = -- ] && shift

fail() {
	echo "sandbox: $*" >&2
	exit 1
}

if [ "$mode" = bind ]; then
	strict=1
	# In a user namespace (not root) a mount's locked flags may keep the
	# read-only remount from working; the user's own permissions then guard
	# the host instead.
	[ "${GPU_CHECK_USERNS:-}" = 1 ] && strict=
	for d in sys proc dev usr etc opt lib lib32 lib64 libx32 bin sbin; do
		s="${src%/}/$d"
		t="$root/$d"
		if [ -L "$s" ]; then
			ln -s "$(readlink "$s")" "$t" || fail "cannot link $t"
		elif [ -d "$s" ]; then
			mkdir -p "$t" || fail "cannot make $t"
			mount --rbind "$s" "$t" || fail "cannot bind $s on $t"
			if ! mount -o remount,bind,ro "$t" 2>/dev/null; then
				[ -n "$strict" ] && fail "cannot make $t read-only; not starting the agent"
				echo "sandbox: $t stays writable in this user namespace (read-only remount refused)" >&2
			fi
		fi
	done
elif [ "$mode" != none ]; then
	fail "unknown mode $mode (bind or none)"
fi
mkdir -p "$root/run" "$root/var/lib/kubelet/device-plugins" || fail "cannot make $root/run, $root/var/lib/kubelet/device-plugins"
echo ready
read -r _go || exit 0
exec "$@" >>"$log" 2>&1
