# Sourced by the two-GPU runbooks (`source "$(dirname "$0")/need_gpus.sh" 2`): stop at once, exit 2, unless
# nvidia-smi lists at least that many GPUs, so that a call on a one-GPU machine costs seconds and says why, instead of
# running each step into its failure or its timeout.
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "$have" -lt "$1" ]; then
  echo "this runbook needs $1 GPUs in one machine (nvidia-h200-x2); nvidia-smi lists $have here: nothing was run" >&2
  exit 2
fi
