# Sourced by the scripts/h200_*.sh device calls: one deadline for a call and its steps.
# The caller sets OUT (results) and DEADLINE (seconds from the call's start); optional: LOGS (where the
# step logs and steps.log go; default OUT), STEPS (the step names to run, space-separated; default
# all), DRY_RUN=1 (print the commands only), TAIL (log lines shown after a step; default 8).
# shellcheck shell=bash

left() { echo $((DEADLINE - SECONDS)); }

# step NAME NEED_S LIMIT_S COMMAND...: COMMAND under `timeout` of min(LIMIT_S, what is left of DEADLINE)
# seconds, its output in $LOGS/NAME.log; skipped when fewer than NEED_S seconds are left or when STEPS
# leaves NAME out. The benchmarks write their JSON as they go, so a step cut short keeps its rows.
step() {
  local name=$1 need=$2 limit=$3 logs=${LOGS:-$OUT} t start rc=0
  shift 3
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  t=$(left)
  [ "$limit" -lt "$t" ] && t=$limit
  if [ "$(left)" -lt "$need" ]; then
    echo "== $name: skipped, $(left) s left" | tee -a "$logs/steps.log"
    return 0
  fi
  echo "== $name (limit $t s, $(left) s left): $*"
  [ "${DRY_RUN:-0}" = 1 ] && return 0
  start=$SECONDS
  timeout "$t" "$@" > "$logs/$name.log" 2>&1 || rc=$?
  echo "== $name: rc $rc after $((SECONDS - start)) s" | tee -a "$logs/steps.log"
  grep -v Warning "$logs/$name.log" | tail -n "${TAIL:-8}"
}
