#!/usr/bin/env bash
# Runs P processes of `python -m jaxformer` on this machine as one multi-process JAX job.
#
#   scripts/launch_local_multihost.sh P -- train --config configs/tiny.yaml --workdir /tmp/run \
#       runtime.num_cpu_devices=4 mesh.data=2 mesh.fsdp=2 mesh.tensor=2
#
# Each process gets --coordinator 127.0.0.1:PORT (a free port) --num-processes P --process-id I
# and simulates its own runtime.num_cpu_devices CPU devices (devices per process).
# Process 0 writes to stdout/stderr; process I>0 to $JAXFORMER_LOG_DIR/process_I.log (default:
# a fresh temporary folder, named on stderr). Environment: PYTHON (default: python).
# Exit status: 0 if all processes succeed, else the first failure's status; the moment one
# process fails the others are killed (they would otherwise wait in a collective), and on
# exit, INT or TERM no process is left behind.
set -u

usage() { echo "usage: $0 P -- train|eval|translate ARGS..." >&2; exit 2; }
[ $# -ge 2 ] || usage
P=$1; shift
[[ "$P" =~ ^[1-9][0-9]*$ ]] || usage
[ "$1" = "--" ] && shift
[ $# -ge 1 ] || usage
COMMAND=$1; shift
PYTHON=${PYTHON:-python}

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || exit 1
LOG_DIR=${JAXFORMER_LOG_DIR:-$(mktemp -d -t jaxformer_multihost.XXXXXX)}
mkdir -p "$LOG_DIR"
[ "$P" -gt 1 ] && echo "launch_local_multihost: $P processes, coordinator 127.0.0.1:$PORT, logs of processes 1..$((P - 1)) in $LOG_DIR" >&2

PIDS=()
cleanup() {
  trap - EXIT INT TERM
  local pid alive=()
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
  [ ${#alive[@]} -eq 0 ] && return
  kill -TERM "${alive[@]}" 2>/dev/null
  for _ in $(seq 50); do  # up to 5 s for a clean exit, then SIGKILL
    local still=()
    for pid in "${alive[@]}"; do kill -0 "$pid" 2>/dev/null && still+=("$pid"); done
    [ ${#still[@]} -eq 0 ] && break
    sleep 0.1
  done
  kill -KILL "${alive[@]}" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for ((i = 0; i < P; i++)); do
  args=("$COMMAND" --coordinator "127.0.0.1:$PORT" --num-processes "$P" --process-id "$i" "$@")
  if [ "$i" -eq 0 ]; then
    "$PYTHON" -m jaxformer "${args[@]}" &
  else
    "$PYTHON" -m jaxformer "${args[@]}" >"$LOG_DIR/process_$i.log" 2>&1 &
  fi
  PIDS+=($!)
done

status=0
remaining=("${PIDS[@]}")
while [ ${#remaining[@]} -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${remaining[@]}"
  rc=$?
  if [ -z "$done_pid" ]; then  # no child left to wait for (should not happen): do not spin
    echo "launch_local_multihost: lost track of the processes (wait status $rc)" >&2
    status=1
    break
  fi
  left=()
  for pid in "${remaining[@]}"; do [ "$pid" != "$done_pid" ] && left+=("$pid"); done
  remaining=("${left[@]+"${left[@]}"}")
  if [ "$rc" -ne 0 ]; then
    failed=?
    for ((i = 0; i < P; i++)); do [ "${PIDS[$i]}" = "$done_pid" ] && failed=$i; done
    echo "launch_local_multihost: process $failed exited with status $rc; stopping the others" >&2
    if [ -f "$LOG_DIR/process_$failed.log" ]; then
      tail -n 20 "$LOG_DIR/process_$failed.log" | sed "s/^/[process $failed] /" >&2
    fi
    status=$rc
    break
  fi
done
exit "$status"
