#!/usr/bin/env bash
# Bring up a real single-node SLURM on this Debian machine: munge, slurmctld, slurmd.
# Idempotent: re-running checks what is up, starts what is missing and resumes a drained node.
#
#   sudo bash slurm/local-cluster.sh            # install (apt) if needed, configure, start
#   AREAL_SLURM_NO_INSTALL=1 bash slurm/local-cluster.sh   # never call apt-get
#   bash slurm/stop-local-cluster.sh            # stop the daemons
#
# The node is described from `slurmd -C` (CPUs, RealMemory) so the config matches this machine.
# Daemons run as root with ProctrackType=proctrack/linuxproc: it needs no cgroup setup, which
# containers often lack. Not for production; for tests and for `areal train launcher=slurm` here.
set -euo pipefail
# The daemons and runuser live in sbin, which a minimal PATH (env -i, cron, some CI runners) leaves out.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
PARTITION=${AREAL_SLURM_PARTITION:-debug}
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOGDIR=/var/log/slurm
RUNDIR=/run/slurm

log() { echo "[local-cluster] $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "[local-cluster] must run as root (it writes $CONF and starts daemons)" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  if [ -n "${AREAL_SLURM_NO_INSTALL:-}" ]; then
    log "slurm-wlm/munge are not installed and AREAL_SLURM_NO_INSTALL is set"; exit 1
  fi
  log "installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurm-wlm munge >/dev/null
fi

ping_ok() { scontrol ping 2>/dev/null | grep -q "is UP"; }
node_state() { sinfo -h -N -o "%T" 2>/dev/null | head -n1; }

# ---------------------------------------------------------------- munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating a munge key"
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null; then mungekey --create --force --keyfile=/etc/munge/munge.key
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
fi
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || { log "munge does not work"; exit 1; }

# ---------------------------------------------------------------- slurm.conf
HOST=$(hostname -s)
NODE_LINE=$(slurmd -C | head -n1)                  # NodeName=vm CPUs=2 ... RealMemory=24105
CPUS=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
MEM=$(( MEM * 95 / 100 ))                          # headroom: slurmd drains a node whose memory shrank
TOPO=$(grep -o 'Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' <<<"$NODE_LINE" || true)

mkdir -p "$CONF_DIR" "$STATE" "$SPOOL" "$LOGDIR" "$RUNDIR"
NEW=$(mktemp)
cat >"$NEW" <<CONF
# Written by areal-cli slurm/local-cluster.sh for a single-node test cluster on $HOST.
ClusterName=areal-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=cred_expire=30
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
JobRequeue=1
SlurmctldPidFile=$RUNDIR/slurmctld.pid
SlurmdPidFile=$RUNDIR/slurmd.pid
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=10
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
Waittime=0
NodeName=$HOST CPUs=$CPUS $TOPO RealMemory=$MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF

RESTART=0
if [ ! -f "$CONF" ] || ! cmp -s "$NEW" "$CONF"; then
  log "writing $CONF (NodeName=$HOST CPUs=$CPUS RealMemory=$MEM)"
  cp "$NEW" "$CONF"; RESTART=1
fi
rm -f "$NEW"
[ -f "$CONF_DIR/cgroup.conf" ] || echo "CgroupPlugin=autodetect" >"$CONF_DIR/cgroup.conf"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$RESTART" = 1 ]; then
  for pf in "$RUNDIR/slurmd.pid" "$RUNDIR/slurmctld.pid"; do
    if alive "$pf"; then log "restarting for the new config: stopping pid $(cat "$pf")"; kill "$(cat "$pf")"; fi
  done
  sleep 1
fi

if ! alive "$RUNDIR/slurmctld.pid"; then
  log "starting slurmctld"
  /usr/sbin/slurmctld
fi
for _ in $(seq 100); do ping_ok && break; sleep 0.2; done
ping_ok || { log "slurmctld is not answering; see $LOGDIR/slurmctld.log"; tail -n 20 "$LOGDIR/slurmctld.log" >&2; exit 1; }

if ! alive "$RUNDIR/slurmd.pid"; then
  log "starting slurmd"
  /usr/sbin/slurmd
fi

for _ in $(seq 100); do
  st=$(node_state)
  case "$st" in
    idle*|mixed*|allocated*|completing*) break ;;
    drain*|down*|fail*)
      log "node $HOST is $st: resuming it"
      scontrol update NodeName="$HOST" State=RESUME || true ;;
  esac
  sleep 0.2
done
st=$(node_state)
case "$st" in
  idle*|mixed*|allocated*|completing*) log "up: node $HOST ($CPUS CPUs, ${MEM} MB) in partition $PARTITION is $st" ;;
  *) log "node $HOST did not come up (state: ${st:-unknown}); see $LOGDIR/slurmd.log"; tail -n 20 "$LOGDIR/slurmd.log" >&2; exit 1 ;;
esac
