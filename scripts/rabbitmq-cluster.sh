#!/usr/bin/env bash
# A three-node RabbitMQ cluster for the cluster tests (tests/cluster), run unattended (CI, root,
# no stdin).
#
#   scripts/rabbitmq-cluster.sh ensure    install if missing, start every node that is not
#                                         running, join them into one cluster, wait until every
#                                         port accepts connections (idempotent: safe to run twice)
#   scripts/rabbitmq-cluster.sh stop      stop the three nodes by process id and check they are gone
#   scripts/rabbitmq-cluster.sh status    one line per node: exit 0 all three running with their
#                                         ports open, 1 some, 3 none
#   scripts/rabbitmq-cluster.sh kill N    SIGKILL node N's Erlang VM (N is 1, 2 or 3)
#   scripts/rabbitmq-cluster.sh start N   start node N again and wait until it is back in the
#                                         cluster and its ports accept connections
#   scripts/rabbitmq-cluster.sh ctl N ARGS  rabbitmqctl against node N (e.g. "ctl 1 list_queues")
#
# Node N is "hafailover-cN@localhost", listening on 127.0.0.1 only: AMQP 0-9-1 and 1.0 on
# 5700+N, STOMP on 61700+N, Erlang distribution on 25700+N. Those stay clear of the single node
# of scripts/rabbitmq.sh (hafailover@localhost, 5672, 61613, 25672), which this script never
# touches: the cluster has its own node names, ports, data and Erlang cookie (so no node of one
# can even connect to the other), and it shares only epmd, which it stops only if it started it
# and no node is left registered. Everything lives under .data/rabbitmq-cluster/: one HOME with
# the cookie all three nodes and the CLI use, and one directory per node (c1, c2, c3) with its
# configuration, Mnesia and quorum queue data, and logs. How a node is run (as the calling user
# from /usr/lib/rabbitmq/bin, HOME under the data directory) is explained in scripts/rabbitmq.sh;
# installing is done through it ("rabbitmq.sh install").
#
# The cluster is for tests: "ensure" with no node running wipes the nodes' data and forms a
# fresh cluster (rabbitmqctl join_cluster, nodes 2 and 3 joining node 1). That spares the
# restart-order rule of a stopped cluster (the last node to stop must start first) and makes the
# result of "ensure" the same whatever was left behind. A node that is killed and started again
# while others run keeps its data and rejoins by itself, as in production.
#
# Environment (all optional):
#   HAFAILOVER_RABBITMQ_CLUSTER_AMQP_BASE   node N's AMQP port is this + N (5700)
#   HAFAILOVER_RABBITMQ_CLUSTER_STOMP_BASE  node N's STOMP port is this + N (61700)
#   HAFAILOVER_RABBITMQ_CLUSTER_DIST_BASE   node N's distribution port is this + N (25700)
#   HAFAILOVER_RABBITMQ_CLUSTER_DATA_DIR    where the cluster lives (<project>/.data/rabbitmq-cluster)
#   HAFAILOVER_RABBITMQ_CLUSTER_START_TIMEOUT  seconds for a node to accept connections (120)
#   HAFAILOVER_RABBITMQ_CLUSTER_STOP_TIMEOUT   seconds for a node to exit (60)
set -euo pipefail

readonly HOST=127.0.0.1
readonly NODES=(1 2 3)
readonly RMQ_BIN=/usr/lib/rabbitmq/bin
readonly PLUGINS="[rabbitmq_amqp1_0,rabbitmq_stomp]."

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AMQP_BASE="${HAFAILOVER_RABBITMQ_CLUSTER_AMQP_BASE:-5700}"
STOMP_BASE="${HAFAILOVER_RABBITMQ_CLUSTER_STOMP_BASE:-61700}"
DIST_BASE="${HAFAILOVER_RABBITMQ_CLUSTER_DIST_BASE:-25700}"
DATA="${HAFAILOVER_RABBITMQ_CLUSTER_DATA_DIR:-$ROOT/.data/rabbitmq-cluster}"
START_TIMEOUT="${HAFAILOVER_RABBITMQ_CLUSTER_START_TIMEOUT:-120}"
STOP_TIMEOUT="${HAFAILOVER_RABBITMQ_CLUSTER_STOP_TIMEOUT:-60}"

EPMD_MARK="$DATA/epmd.started-by-us"

say() { printf 'rabbitmq-cluster.sh: %s\n' "$*" >&2; }

die() {
    say "ERROR: $*"
    exit 1
}

check_number() { # name value min max
    if ! [[ "$2" =~ ^[0-9]+$ ]] || ((10#$2 < $3 || 10#$2 > $4)); then
        die "$1 must be a whole number from $3 to $4, got '$2'"
    fi
}

# ---------------------------------------------------------------------------------------------
# one node: its name, ports and files
# ---------------------------------------------------------------------------------------------
node_name() { printf 'hafailover-c%s@localhost\n' "$1"; }
amqp_port() { printf '%s\n' "$((10#$AMQP_BASE + $1))"; }
stomp_port() { printf '%s\n' "$((10#$STOMP_BASE + $1))"; }
dist_port() { printf '%s\n' "$((10#$DIST_BASE + $1))"; }
node_dir() { printf '%s\n' "$DATA/c$1"; }
pid_file() { printf '%s\n' "$DATA/c$1/rabbitmq.pid"; }
log_dir() { printf '%s\n' "$DATA/c$1/log"; }
crash_dump() { printf '%s\n' "$DATA/c$1/log/erl_crash.dump"; }

check_node_number() {
    [[ "$1" =~ ^[1-3]$ ]] || die "a node number is 1, 2 or 3, got '$1'"
}

rmq_env() { # N: the environment of every RabbitMQ / Erlang command run for node N
    local dir
    dir="$(node_dir "$1")"
    export HOME="$DATA/home" # one cookie for the three nodes and the CLI
    export LANG=C.UTF-8 LC_ALL=C.UTF-8
    export RABBITMQ_NODENAME
    RABBITMQ_NODENAME="$(node_name "$1")"
    export RABBITMQ_USE_LONGNAME=false
    export RABBITMQ_NODE_IP_ADDRESS="$HOST"
    export RABBITMQ_NODE_PORT
    RABBITMQ_NODE_PORT="$(amqp_port "$1")"
    export RABBITMQ_DIST_PORT
    RABBITMQ_DIST_PORT="$(dist_port "$1")"
    # the CLI's own distribution ports, away from the single node's CLI (35672-35682)
    export RABBITMQ_CTL_DIST_PORT_MIN="$((10#$DIST_BASE + 10000))"
    export RABBITMQ_CTL_DIST_PORT_MAX="$((10#$DIST_BASE + 10030))"
    export RABBITMQ_CONF_ENV_FILE="$dir/etc/rabbitmq-env.conf"
    export RABBITMQ_CONFIG_FILE="$dir/etc/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/etc/advanced.config" # absent on purpose
    export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/etc/enabled_plugins"
    export RABBITMQ_MNESIA_BASE="$dir/mnesia"
    export RABBITMQ_LOG_BASE="$dir/log"
    export RABBITMQ_PID_FILE
    RABBITMQ_PID_FILE="$(pid_file "$1")"
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export ERL_EPMD_ADDRESS="$HOST"
    export ERL_CRASH_DUMP
    ERL_CRASH_DUMP="$(crash_dump "$1")"
}

ctl() { # N timeout-seconds args...: rabbitmqctl against node N
    local n="$1" t="$2"
    shift 2
    (rmq_env "$n" && cd "$(node_dir "$n")" &&
        timeout "$t" "$RMQ_BIN/rabbitmqctl" -n "$(node_name "$n")" "$@" </dev/null 9>&-)
}

show_logs() { # N
    local f dump
    dump="$(crash_dump "$1")"
    if [[ -s "$dump" ]]; then
        say "node $1's Erlang VM crashed: $(grep -m1 '^Slogan:' "$dump" || true)"
    fi
    for f in "$(log_dir "$1")/startup.log" "$(log_dir "$1")/$(node_name "$1").log"; do
        if [[ -s "$f" ]]; then
            say "--- last 40 lines of $f ---"
            tail -n 40 "$f" >&2 || true
        fi
    done
}

write_files() { # the cookie, and each node's configuration
    mkdir -p "$DATA/home"
    chmod 700 "$DATA/home"
    local cookie="$DATA/home/.erlang.cookie"
    if [[ ! -s "$cookie" ]]; then
        (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$cookie.tmp")
        mv "$cookie.tmp" "$cookie"
    fi
    chmod 400 "$cookie" # Erlang refuses a cookie file that others can read
    local n dir
    for n in "${NODES[@]}"; do
        dir="$(node_dir "$n")"
        mkdir -p "$dir/etc" "$dir/mnesia" "$dir/log"
        : >"$dir/etc/rabbitmq-env.conf"
        # What "rabbitmq-plugins enable --offline rabbitmq_stomp rabbitmq_amqp1_0" writes, written
        # here directly: the node reads the file at boot, and the CLI would cost ~2 s a node.
        printf '%s\n' "$PLUGINS" >"$dir/etc/enabled_plugins"
        # written beside the live one: ensure compares them to find a changed configuration
        cat >"$dir/etc/rabbitmq.conf.new" <<EOF
# written by scripts/rabbitmq-cluster.sh; edits are overwritten
listeners.tcp.1 = $HOST:$(amqp_port "$n")
stomp.listeners.tcp.1 = $HOST:$(stomp_port "$n")
loopback_users.guest = true
default_user = guest
default_pass = guest
stomp.default_user = guest
stomp.default_pass = guest
log.file.level = info
log.console = false
EOF
    done
}

config_changed() { # N: the written configuration differs from the one node N runs with
    local dir
    dir="$(node_dir "$1")"
    ! cmp -s "$dir/etc/rabbitmq.conf" "$dir/etc/rabbitmq.conf.new"
}

# ---------------------------------------------------------------------------------------------
# process state
# ---------------------------------------------------------------------------------------------
alive() { # a zombie (exited, not yet reaped by pid 1) counts as gone
    local st
    st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ -n "$st" && "$st" != Z* ]]
}

node_pid() { # N: prints the pid of node N if it is alive, else fails
    local file pid
    file="$(pid_file "$1")"
    [[ -s "$file" ]] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    [[ -n "$pid" ]] && alive "$pid" || return 1
    # guard against pid reuse: the process this script started for node N (its environment
    # names the pid file; RabbitMQ 3.10 has no node name on its command line)
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "RABBITMQ_PID_FILE=$file" || return 1
    printf '%s\n' "$pid"
}

port_open() {
    # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$HOST" "$1" 2>/dev/null
}

port_owner() { ss -ltnpH "sport = :$1" 2>/dev/null | head -n 3; }

ports_open() { # N: both client ports of node N accept connections
    port_open "$(amqp_port "$1")" && port_open "$(stomp_port "$1")"
}

running_nodes() { # the numbers of the nodes whose VM is alive
    local n
    for n in "${NODES[@]}"; do
        if node_pid "$n" >/dev/null; then printf '%s\n' "$n"; fi
    done
}

epmd_bin() {
    local e
    for e in /usr/bin/epmd /usr/lib/erlang/bin/epmd /usr/lib/erlang/erts-*/bin/epmd; do
        [[ -x "$e" ]] && printf '%s\n' "$e" && return 0
    done
    return 1
}

epmd_up() {
    local e
    e="$(epmd_bin)" || return 1
    "$e" -names >/dev/null 2>&1
}

stop_epmd() {
    # epmd outlives the nodes and is shared with the single node: stop it only if this script
    # launched it and no node at all (ours or another) is registered in it
    [[ -e "$EPMD_MARK" ]] || return 0
    rm -f "$EPMD_MARK"
    local e
    e="$(epmd_bin)" || return 0
    if "$e" -names 2>/dev/null | grep -q '^name '; then
        return 0
    fi
    (export ERL_EPMD_ADDRESS="$HOST" && "$e" -kill >/dev/null 2>&1) || true
}

is_installed() {
    [[ -x "$RMQ_BIN/rabbitmq-server" ]] &&
        [[ "$(dpkg-query -W -f='${Status}' rabbitmq-server 2>/dev/null)" == "install ok installed" ]]
}

# ---------------------------------------------------------------------------------------------
# start, join, stop
# ---------------------------------------------------------------------------------------------
launch_node() { # N: start node N's VM detached (returns at once; wait_ready waits)
    local n="$1" dir p
    dir="$(node_dir "$n")"
    for p in "$(amqp_port "$n")" "$(stomp_port "$n")" "$(dist_port "$n")"; do
        if port_open "$p"; then
            say "port $HOST:$p is in use by another process:"
            port_owner "$p" >&2 || true
            die "cannot start node $n: port $p is taken (set HAFAILOVER_RABBITMQ_CLUSTER_*_BASE or stop that process)"
        fi
    done
    mv "$dir/etc/rabbitmq.conf.new" "$dir/etc/rabbitmq.conf"
    rm -f "$(pid_file "$n")"
    [[ ! -e "$(crash_dump "$n")" ]] || mv -f "$(crash_dump "$n")" "$(crash_dump "$n").old"
    say "starting node $n $(node_name "$n")"
    # 9>&-: the detached node (and epmd) must not inherit the lock, or the next call would wait
    (rmq_env "$n" && cd "$dir" && "$RMQ_BIN/rabbitmq-server" -detached \
        </dev/null >"$(log_dir "$n")/startup.log" 2>&1 9>&-) || {
        show_logs "$n"
        die "rabbitmq-server -detached failed for node $n"
    }
}

wait_ready() { # N deadline: both ports of node N accept; fails early if the node dies
    local n="$1" deadline="$2" pid=""
    while ((SECONDS < deadline)); do
        if [[ -n "$pid" ]] && ! alive "$pid"; then
            show_logs "$n"
            die "node $n (pid $pid) exited during start"
        fi
        if [[ -z "$pid" ]]; then
            pid="$(node_pid "$n")" || pid=""
            # a VM that dies in early boot (bad config, name clash) leaves no pid, only a dump
            if [[ -z "$pid" && -s "$(crash_dump "$n")" ]]; then
                show_logs "$n"
                die "node $n failed to boot"
            fi
        fi
        if [[ -n "$pid" ]] && ports_open "$n"; then
            return 0
        fi
        sleep 0.3
    done
    show_logs "$n"
    die "node $n did not accept connections on $HOST:$(amqp_port "$n") (AMQP) and $HOST:$(stomp_port "$n") (STOMP) within ${START_TIMEOUT}s"
}

seen_running() { # N: the running cluster members as node N sees them, one name a line
    ctl "$1" 60 eval 'rabbit_nodes:all_running().' 2>/dev/null | grep -oE 'hafailover-c[0-9]+@localhost' | sort -u
}

wait_clustered() { # N deadline: node N sees every node whose VM runs, and no other
    local n="$1" deadline="$2" want seen="" m
    want="$(for m in $(running_nodes); do node_name "$m"; done | sort -u)"
    while ((SECONDS < deadline)); do
        seen="$(seen_running "$n" || true)"
        [[ "$seen" == "$want" ]] && return 0
        sleep 0.5
    done
    die "node $n is not back in the cluster within ${START_TIMEOUT}s: it sees [$(echo $seen)], running are [$(echo $want)]"
}

join_node() { # N: make node N a member of node 1's cluster (rabbitmqctl join_cluster)
    local n="$1" log
    log="$(log_dir "$n")/join.log"
    say "joining node $n to $(node_name 1)"
    {
        ctl "$n" 120 stop_app &&
            ctl "$n" 120 join_cluster "$(node_name 1)" &&
            ctl "$n" 120 start_app
    } >"$log" 2>&1 || {
        cat "$log" >&2
        die "node $n could not join the cluster of $(node_name 1)"
    }
}

wipe_node() { # N: forget node N's data (only ever while it is down)
    local dir
    dir="$(node_dir "$1")"
    rm -rf "$dir/mnesia" "$dir/log"
    mkdir -p "$dir/mnesia" "$dir/log"
}

stop_nodes() { # N...: SIGTERM (a clean Erlang shutdown), then SIGKILL if one hangs
    local n pid deadline
    local -A pids=()
    for n in "$@"; do
        if pid="$(node_pid "$n")"; then
            pids[$n]="$pid"
            say "stopping node $n $(node_name "$n") (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
        fi
        rm -f "$(node_dir "$n")/etc/rabbitmq.conf.new"
    done
    deadline=$((SECONDS + STOP_TIMEOUT))
    for n in "${!pids[@]}"; do
        while alive "${pids[$n]}" && ((SECONDS < deadline)); do sleep 0.2; done
        if alive "${pids[$n]}"; then
            say "node $n (pid ${pids[$n]}) still alive after ${STOP_TIMEOUT}s; sending SIGKILL"
            kill -KILL "${pids[$n]}" 2>/dev/null || true
            sleep 0.5
        fi
        ! alive "${pids[$n]}" || die "node $n (pid ${pids[$n]}) did not exit"
        rm -f "$(pid_file "$n")"
    done
    for n in "$@"; do
        ! ports_open_any "$n" || die "node $n is gone but one of its ports still accepts connections"
    done
}

ports_open_any() { port_open "$(amqp_port "$1")" || port_open "$(stomp_port "$1")"; }

# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
cmd_ensure() {
    if ! is_installed; then
        bash "$ROOT/scripts/rabbitmq.sh" install || die "could not install rabbitmq-server"
    fi
    write_files
    local n running changed=() deadline
    running="$(running_nodes)"
    for n in $running; do
        if config_changed "$n"; then changed+=("$n"); fi
    done
    if ((${#changed[@]})); then
        say "the configuration of node(s) ${changed[*]} changed (ports?): starting afresh"
        stop_nodes "${NODES[@]}"
        running=""
    fi
    if [[ -z "$running" ]]; then
        [[ -e "$EPMD_MARK" ]] || epmd_up || : >"$EPMD_MARK"
        for n in "${NODES[@]}"; do wipe_node "$n"; done
    fi
    local t0=$SECONDS
    deadline=$((SECONDS + START_TIMEOUT))
    local started=()
    for n in "${NODES[@]}"; do
        if [[ " $(echo $running) " != *" $n "* ]]; then
            launch_node "$n"
            started+=("$n")
        else
            rm -f "$(node_dir "$n")/etc/rabbitmq.conf.new"
        fi
    done
    for n in "${NODES[@]}"; do wait_ready "$n" "$deadline"; done
    # a node started on wiped data stands alone: it joins; one that ran before rejoins by itself
    local members
    members="$(seen_running 1 || true)"
    for n in 2 3; do
        if ! grep -qxF "$(node_name "$n")" <<<"$members"; then
            join_node "$n"
        fi
    done
    deadline=$((SECONDS + START_TIMEOUT))
    for n in "${NODES[@]}"; do wait_ready "$n" "$deadline"; done
    wait_clustered 1 "$deadline"
    if ((${#started[@]})); then
        say "cluster ready in $((SECONDS - t0))s (started node(s) ${started[*]})"
    else
        say "already running"
    fi
    for n in "${NODES[@]}"; do
        printf 'rabbitmq-cluster: node %s %s stomp %s:%s amqp %s:%s\n' "$n" "$(node_name "$n")" \
            "$HOST" "$(stomp_port "$n")" "$HOST" "$(amqp_port "$n")"
    done
}

cmd_stop() {
    [[ -d "$DATA" ]] || {
        say "not running (no $DATA)"
        return 0
    }
    stop_nodes "${NODES[@]}"
    stop_epmd
    say "stopped"
}

cmd_kill() { # N
    local n="$1" pid
    pid="$(node_pid "$n")" || die "node $n is not running"
    kill -KILL "$pid"
    local deadline=$((SECONDS + 10))
    while alive "$pid" && ((SECONDS < deadline)); do sleep 0.05; done
    ! alive "$pid" || die "node $n (pid $pid) survived SIGKILL"
    rm -f "$(pid_file "$n")"
    say "killed node $n $(node_name "$n") (pid $pid)"
}

cmd_start() { # N
    local n="$1" t0=$SECONDS deadline
    [[ -s "$DATA/home/.erlang.cookie" && -s "$(node_dir "$n")/etc/rabbitmq.conf" ]] ||
        die "no cluster set up in $DATA (run ensure)"
    if [[ -z "$(running_nodes)" ]]; then
        # RabbitMQ lets the node that stopped last start alone; any other waits for it
        say "no node of the cluster runs: node $n starts alone, as the last node to stop must"
    fi
    deadline=$((SECONDS + START_TIMEOUT))
    if node_pid "$n" >/dev/null; then
        say "node $n already running"
    else
        cp "$(node_dir "$n")/etc/rabbitmq.conf" "$(node_dir "$n")/etc/rabbitmq.conf.new"
        launch_node "$n"
    fi
    wait_ready "$n" "$deadline"
    wait_clustered "$n" "$deadline"
    say "node $n (pid $(node_pid "$n")) back in the cluster in $((SECONDS - t0))s"
}

node_line() { # N: the status of node N; fails unless it runs with both ports open
    local n="$1" pid amqp=closed stomp=closed
    if pid="$(node_pid "$n")"; then
        port_open "$(amqp_port "$n")" && amqp=open
        port_open "$(stomp_port "$n")" && stomp=open
        printf 'rabbitmq-cluster: node %s %s running pid %s stomp %s:%s (%s) amqp %s:%s (%s)\n' \
            "$n" "$(node_name "$n")" "$pid" "$HOST" "$(stomp_port "$n")" "$stomp" \
            "$HOST" "$(amqp_port "$n")" "$amqp"
        [[ "$amqp" == open && "$stomp" == open ]]
    else
        printf 'rabbitmq-cluster: node %s %s not running\n' "$n" "$(node_name "$n")"
        return 1
    fi
}

cmd_status() {
    local n up=0
    for n in "${NODES[@]}"; do
        if node_line "$n"; then up=$((up + 1)); fi
    done
    ((up == ${#NODES[@]})) && return 0
    [[ -n "$(running_nodes)" ]] && return 1
    return 3
}

locked() { # command args...: one ensure/stop/kill/start at a time (parallel test sessions)
    mkdir -p "$DATA"
    exec 9>"$DATA/.lock"
    flock -w "$((START_TIMEOUT * 3 + 900))" 9 || die "another rabbitmq-cluster.sh holds $DATA/.lock"
    "$@"
}

main() {
    local cmd="${1:-}"
    check_number HAFAILOVER_RABBITMQ_CLUSTER_AMQP_BASE "$AMQP_BASE" 1 65532
    check_number HAFAILOVER_RABBITMQ_CLUSTER_STOMP_BASE "$STOMP_BASE" 1 65532
    check_number HAFAILOVER_RABBITMQ_CLUSTER_DIST_BASE "$DIST_BASE" 1 55500
    check_number HAFAILOVER_RABBITMQ_CLUSTER_START_TIMEOUT "$START_TIMEOUT" 1 3600
    check_number HAFAILOVER_RABBITMQ_CLUSTER_STOP_TIMEOUT "$STOP_TIMEOUT" 1 3600
    case "$cmd" in
        ensure | stop)
            [[ $# == 1 ]] || die "$cmd takes no argument"
            locked "cmd_$cmd"
            ;;
        kill | start)
            [[ $# == 2 ]] || die "usage: $0 $cmd N (N is 1, 2 or 3)"
            check_node_number "$2"
            locked "cmd_$cmd" "$2"
            ;;
        status) cmd_status ;;
        ctl)
            [[ $# -ge 2 ]] || die "usage: $0 ctl N ARGS..."
            check_node_number "$2"
            [[ -s "$DATA/home/.erlang.cookie" ]] || die "no cluster set up in $DATA (run ensure)"
            local n="$2"
            shift 2
            ctl "$n" "$STOP_TIMEOUT" "$@"
            ;;
        *)
            echo "usage: $0 ensure|stop|status|kill N|start N|ctl N ARGS..." >&2
            exit 2
            ;;
    esac
}

main "$@"
