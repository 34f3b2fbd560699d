#!/usr/bin/env bash
# A real Slurm cluster on one machine, without systemd: munged, MariaDB + slurmdbd (so sacct
# and submitit work), slurmctld, and several slurmd that emulate nodes n1..nN.
#
#   bash env/cluster.sh start    # idempotent: starts only what is not running
#   bash env/cluster.sh status
#   bash env/cluster.sh stop     # cancels jobs, stops exactly the PIDs it started
#   source .cluster/env.sh       # SLURM_CONF for sbatch/srun/squeue/sacct
#
# Partitions: rollout = n[1-2] (default), train = n[3-4], all = n[1-4].
# Settings that this kind of machine needs, and why:
#   SchedulerParameters=bf_interval=1  heterogeneous jobs start only through backfill
#   TmpFS=<dir>/tmp/%n                 two slurmd on one host clash under PMIx without it
#   KillOnBadExit=1                    else a crashed rank leaves the others hanging
#   MpiDefault=pmi2                    pip's MPICH works with pmi2 (Debian MPICH + pmix: singletons)
#   SlurmdParameters=config_overrides  nodes declare CPUs/memory the host does not really have
#   slurmdbd + MariaDB                 sacct; submitit's job states (without it result() hangs)
# Root dir: $NEON_CLUSTER_DIR (default <repo>/.cluster). Ports: $NEON_SLURM_PORT_BASE (16800).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
C="${NEON_CLUSTER_DIR:-$ROOT/.cluster}"
NODES="${NEON_SLURM_NODES:-4}"
BASE="${NEON_SLURM_PORT_BASE:-16800}"
CTLD_PORT=$((BASE + 17)); DBD_PORT=$((BASE + 19)); DB_PORT=$((BASE + 6)); NODE_PORT0=$((BASE + 201))
HOST="$(hostname -s)"
DB_PASS_FILE="$C/etc/db.pass"
log() { printf '[cluster %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { echo "cluster.sh: $*" >&2; exit 1; }

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# What this `start` began, newest last: on a failed start the EXIT trap stops exactly these
# (pid files of daemons; munged's pid), so a half-started cluster never keeps a port or the DB.
BEGAN=()

wait_for() {  # wait_for SECONDS DESCRIPTION PIDFILE|pid:N|- COMMAND...  (fails early once that process died)
  local t=$1 what=$2 who=$3 i; shift 3
  for ((i = 0; i < t * 5; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    # a daemon that wrote its pid file (removed before its start, so never a stale one) and died
    # will not come up; nor will a process we started ourselves that is gone
    case $who in
      -) ;;
      pid:*) kill -0 "${who#pid:}" 2>/dev/null || die "$what exited while starting; see $C/log/" ;;
      *) if [[ -f $who ]] && ! alive "$who"; then die "$what exited while starting; see $C/log/"; fi ;;
    esac
    sleep 0.2
  done
  die "$what did not come up within ${t}s; see $C/log/"
}

# The ports this cluster binds: NAME PORT per line (NEON_SLURM_PORT_BASE + a fixed offset).
ports() {
  echo "mariadb $DB_PORT"; echo "slurmdbd $DBD_PORT"; echo "slurmctld $CTLD_PORT"
  for ((n = 1; n <= NODES; n++)); do echo "slurmd-n$n $((NODE_PORT0 + n - 1))"; done
}

port_owner() {  # the pid and command line of whoever listens on TCP port $1 ("" if none)
  local line pid
  if ! command -v ss >/dev/null; then   # no iproute2: a connect tells taken from free, not who
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then echo "a process (install iproute2's ss to see which)"; fi
    return 0
  fi
  line=$(ss -H -ltnp "sport = :$1" 2>/dev/null | head -1) || true
  [[ -n $line ]] || return 0
  pid=$(grep -o 'pid=[0-9]*' <<<"$line" | head -1 | cut -d= -f2)
  if [[ -n $pid && -r /proc/$pid/cmdline ]]; then
    echo "pid $pid: $(tr '\0\n' '  ' </proc/"$pid"/cmdline | cut -c1-200)"
  else
    echo "an unknown process ($line)"
  fi
}

check_ports() {  # before starting anything: refuse ports taken by something that is not ours
  local name port own pidf
  while read -r name port; do
    case $name in
      mariadb) pidf=$C/run/mysqld.pid ;; slurmd-n*) pidf=$C/run/slurmd.${name#slurmd-}.pid ;;
      *) pidf=$C/run/$name.pid ;;
    esac
    alive "$pidf" && continue          # ours, already running: start leaves it alone
    own=$(port_owner "$port")
    [[ -z $own ]] && continue
    die "port $port ($name = NEON_SLURM_PORT_BASE $BASE + $((port - BASE))) is already taken by $own.
  Probably another checkout's cluster. Either use that one (export SLURM_CONF=<its dir>/etc/slurm.conf),
  or start this one on other ports, e.g.:  NEON_SLURM_PORT_BASE=$((BASE + 1000)) bash env/cluster.sh start
  (set NEON_SLURM_PORT_BASE the same way for every later status/stop of this cluster)"
  done < <(ports)
}

undo_failed_start() {  # EXIT trap of `start`: on failure, stop what this invocation began
  local rc=$? i entry
  trap - EXIT
  [[ $rc -eq 0 || ${#BEGAN[@]} -eq 0 ]] && exit "$rc"
  log "start failed: stopping what it started (${#BEGAN[@]} part(s))" >&2
  for ((i = ${#BEGAN[@]} - 1; i >= 0; i--)); do
    entry=${BEGAN[$i]}
    case $entry in
      pid:*) stop_pid_n "${entry#pid:}" ;;
      *) stop_pid "$entry" ;;
    esac
  done
  rm -f "$C/run/munged.ours"
  exit "$rc"
}

write_config() {
  mkdir -p "$C"/{etc,log,run,spool/ctld,mysql}
  for ((n = 1; n <= NODES; n++)); do mkdir -p "$C/spool/n$n" "$C/tmp/n$n"; done
  [[ -f "$DB_PASS_FILE" ]] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$DB_PASS_FILE")
  local last=$((NODE_PORT0 + NODES - 1)) half=$((NODES / 2))
  cat > "$C/etc/slurm.conf" <<EOF
# written by env/cluster.sh; edit the script, not this file
ClusterName=neon
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$C/spool/ctld
SlurmdSpoolDir=$C/spool/%n
SlurmctldPidFile=$C/run/slurmctld.pid
SlurmdPidFile=$C/run/slurmd.%n.pid
SlurmctldLogFile=$C/log/slurmctld.log
SlurmdLogFile=$C/log/slurmd.%n.log
TmpFS=$C/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmi2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillOnBadExit=1
JobRequeue=1
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
MessageTimeout=20
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$NODE_PORT0-$last CPUs=4 RealMemory=4096 State=UNKNOWN
PartitionName=rollout Nodes=n[1-$half] Default=YES MaxTime=INFINITE State=UP
PartitionName=train Nodes=n[$((half + 1))-$NODES] MaxTime=INFINITE State=UP
PartitionName=all Nodes=n[1-$NODES] MaxTime=INFINITE State=UP
EOF
  (umask 077; cat > "$C/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DB_PASS_FILE")
StorageLoc=slurm_acct_db
PidFile=$C/run/slurmdbd.pid
LogFile=$C/log/slurmdbd.log
EOF
  )
  echo "export SLURM_CONF=$C/etc/slurm.conf" > "$C/env.sh"
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  [[ -f /etc/munge/munge.key ]] || { (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null); chown munge:munge /etc/munge/munge.key; }
  log "starting munged"
  if [[ $(id -u) -eq 0 ]]; then runuser -u munge -- /usr/sbin/munged; else /usr/sbin/munged; fi
  local pid; pid=$(pgrep -x -n munged || true)
  echo "$pid" > "$C/run/munged.ours"     # its pid: stop ends that process, not every munged
  [[ -n $pid ]] && BEGAN+=("pid:$pid")
  wait_for 10 munged - munge -n
}

start_db() {
  alive "$C/run/mysqld.pid" && return
  if [[ ! -d "$C/mysql/mysql" ]]; then
    log "initialising MariaDB in $C/mysql"
    mariadb-install-db --user=root --datadir="$C/mysql" --auth-root-authentication-method=socket \
      --skip-test-db >"$C/log/mysql-install.log" 2>&1 || die "mariadb-install-db failed; see $C/log/mysql-install.log"
  fi
  log "starting MariaDB (127.0.0.1:$DB_PORT)"
  rm -f "$C/run/mysqld.pid"
  nohup mariadbd --user=root --datadir="$C/mysql" --socket="$C/run/mysql.sock" --port="$DB_PORT" \
    --bind-address=127.0.0.1 --pid-file="$C/run/mysqld.pid" --log-error="$C/log/mysql.log" \
    --innodb-buffer-pool-size=32M --skip-name-resolve >/dev/null 2>&1 &
  local pid=$!                           # it runs in the foreground of that job: $! is mariadbd
  BEGAN+=("pid:$pid")
  wait_for 30 MariaDB "pid:$pid" mariadb -S "$C/run/mysql.sock" -u root -e "select 1"
  local pw; pw=$(cat "$DB_PASS_FILE")
  mariadb -S "$C/run/mysql.sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    FLUSH PRIVILEGES;"
}

start_dbd() {
  alive "$C/run/slurmdbd.pid" && return
  log "starting slurmdbd (127.0.0.1:$DBD_PORT)"
  rm -f "$C/run/slurmdbd.pid"; BEGAN+=("$C/run/slurmdbd.pid")   # it daemonizes: its pid file names it
  SLURM_CONF="$C/etc/slurm.conf" slurmdbd  # reads slurmdbd.conf beside SLURM_CONF
  wait_for 30 slurmdbd "$C/run/slurmdbd.pid" env SLURM_CONF="$C/etc/slurm.conf" sacctmgr -n list cluster
  SLURM_CONF="$C/etc/slurm.conf" sacctmgr -i -Q add cluster neon >/dev/null 2>&1 || true
}

start_ctld() {
  alive "$C/run/slurmctld.pid" && return
  log "starting slurmctld (127.0.0.1:$CTLD_PORT)"
  rm -f "$C/run/slurmctld.pid"; BEGAN+=("$C/run/slurmctld.pid")
  SLURM_CONF="$C/etc/slurm.conf" slurmctld -f "$C/etc/slurm.conf"
  wait_for 30 slurmctld "$C/run/slurmctld.pid" env SLURM_CONF="$C/etc/slurm.conf" scontrol ping
}

start_slurmd() {
  for ((n = 1; n <= NODES; n++)); do
    alive "$C/run/slurmd.n$n.pid" && continue
    log "starting slurmd n$n"
    rm -f "$C/run/slurmd.n$n.pid"; BEGAN+=("$C/run/slurmd.n$n.pid")
    SLURM_CONF="$C/etc/slurm.conf" slurmd -f "$C/etc/slurm.conf" -N "n$n"
  done
  # a node that was down when slurmctld started comes back by itself (ReturnToService=2)
  wait_for 60 "all $NODES nodes idle" - bash -c \
    "[[ \$(SLURM_CONF=$C/etc/slurm.conf sinfo -h -N -o '%N %t' | awk '\$2 ~ /^(idle|mix|alloc)/' | sort -u | wc -l) -ge $NODES ]]"
}

link_etc() {
  # plain `sbatch` without SLURM_CONF finds the cluster too, unless the machine has its own or
  # the link names another checkout's cluster that still exists (that one keeps it)
  local etc=/etc/slurm/slurm.conf
  [[ $(id -u) -eq 0 ]] || return 0
  if [[ ! -e $etc && ! -L $etc ]] || [[ -L $etc && ( ! -e $etc || $(readlink "$etc") == "$C/etc/slurm.conf" ) ]]; then
    mkdir -p /etc/slurm && ln -sfn "$C/etc/slurm.conf" "$etc"
  elif [[ -L $etc ]]; then
    log "$etc names $(readlink "$etc") (another cluster): left alone; use: source $C/env.sh"
  fi
}

cmd_start() {
  command -v slurmctld >/dev/null || die "Slurm is not installed; run: bash env/setup.sh"
  [[ $NODES =~ ^[0-9]+$ && $NODES -ge 2 ]] || die "NEON_SLURM_NODES=$NODES: need a whole number >= 2 (rollout and train partitions)"
  [[ $BASE =~ ^[0-9]+$ && $BASE -ge 1024 && $((BASE + 201 + NODES)) -le 65535 ]] || \
    die "NEON_SLURM_PORT_BASE=$BASE: need a number from 1024 to $((65535 - 201 - NODES)) (the cluster uses BASE+6 .. BASE+$((200 + NODES)))"
  write_config
  check_ports
  trap undo_failed_start EXIT
  start_munge; start_db; start_dbd; start_ctld; start_slurmd; link_etc
  log "cluster up: $(SLURM_CONF=$C/etc/slurm.conf sinfo -h -o '%P:%D:%t' | tr '\n' ' ')"
  log "use it with: source $C/env.sh"
}

stop_pid() {  # stop_pid PIDFILE
  local f=$1
  alive "$f" || { rm -f "$f"; return 0; }
  stop_pid_n "$(cat "$f")"
  rm -f "$f"
}

stop_pid_n() {  # stop_pid_n PID: TERM, up to 10 s, then KILL; only a cluster daemon (a pid file
  local pid=$1 i comm         # may be stale and its pid reused by an unrelated process)
  comm=$(cat /proc/"$pid"/comm 2>/dev/null) || return 0
  case $comm in
    munged|mariadbd|mysqld|slurmdbd|slurmctld|slurmd) ;;
    *) log "pid $pid is '$comm', not a cluster daemon (stale pid file?): left alone" >&2; return 0 ;;
  esac
  kill "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

cmd_stop() {
  [[ -d "$C" ]] || { log "nothing to stop"; return 0; }
  if alive "$C/run/slurmctld.pid"; then
    SLURM_CONF="$C/etc/slurm.conf" scancel --full --quiet -u "$(id -un)" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      [[ -z $(SLURM_CONF="$C/etc/slurm.conf" squeue -h -t R,CG,CF 2>/dev/null) ]] && break; sleep 0.2
    done
  fi
  for ((n = 1; n <= NODES; n++)); do stop_pid "$C/run/slurmd.n$n.pid"; done
  # job steps outlive a killed slurmd: end the ones of this cluster (its spool dir is in argv/cwd)
  pkill -9 -f "slurmstepd.*$C" 2>/dev/null || true
  stop_pid "$C/run/slurmctld.pid"
  stop_pid "$C/run/slurmdbd.pid"
  stop_pid "$C/run/mysqld.pid"
  if [[ -f "$C/run/munged.ours" ]]; then   # the munged this cluster started (its pid), no other
    local mpid; mpid=$(cat "$C/run/munged.ours")
    if [[ -n $mpid && $(cat /proc/"$mpid"/comm 2>/dev/null) == munged ]]; then stop_pid_n "$mpid"; fi
    rm -f "$C/run/munged.ours"
  fi
  log "cluster stopped"
}

cmd_status() {
  for f in "$C"/run/*.pid; do
    [[ -e $f ]] || continue
    if alive "$f"; then echo "up   $(basename "$f" .pid) pid $(cat "$f")"; else echo "DOWN $(basename "$f" .pid)"; fi
  done
  alive "$C/run/slurmctld.pid" && SLURM_CONF="$C/etc/slurm.conf" sinfo || true
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) cmd_stop; cmd_start ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|restart|status" >&2; exit 2 ;;
esac
