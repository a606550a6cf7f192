# The init (PID 1) of a workspace sandbox; see envs/workspace.py for the other side.
# Run as: bash --noprofile --norc /.agentrl/init.sh NPROC NOFILE FSIZE_KIB AS_KIB
# Descriptors: 0 /dev/null, 1 and 2 the output pipe, 4 the host's commands (read), 5 reports to the host
# (write, NUL-terminated: "ready", "shell NSPID", "exited CODE", and the shell's "NONCE CODE CWD" per call).
# It sets the limits (hard and soft: nothing inside can raise them), unpacks the base tree into the
# workspace, then keeps one non-interactive bash reading the host's commands alive: when that shell
# exits (`exit`, or the host killed it), a new one starts. As PID 1 it also reaps every orphan, and a
# signal sent to it from inside the sandbox is ignored by the kernel; when it dies, the kernel kills
# everything in the sandbox and its tmpfs mounts (the workspace) are freed.
ulimit -S -H -c 0 -u "$1" -n "$2" -f "$3" -v "$4" || { builtin printf 'error limits\0' >&5; exit 1; }
if [ -s /.agentrl/base.tar ]; then
    /usr/bin/tar -xf /.agentrl/base.tar -C /workspace --no-same-owner --delay-directory-restore \
        || { builtin printf 'error base\0' >&5; exit 1; }
fi
cd /workspace || exit 1
builtin printf 'ready\0' >&5
exec 2>/dev/null  # (bash's notes on killed jobs: not the agent's output)
while :; do
    /usr/bin/bash --noprofile --norc 0<&4 2>&1 &
    builtin printf 'shell %d\0' "$!" >&5
    wait "$!"
    builtin printf 'exited %d\0' "$?" >&5
done
