#!/usr/bin/env bash
# RabbitMQ for the interop tests and benchmarks, run unattended (CI, root, no stdin).
#
#   scripts/rabbitmq.sh ensure   install if missing, enable the STOMP and AMQP 1.0 plugins, start
#                                the node if it is not running, wait until both ports accept
#                                connections (idempotent: safe to run twice)
#   scripts/rabbitmq.sh stop     stop the node this script started and check that it is gone
#   scripts/rabbitmq.sh status   say whether it runs: exit 0 running, 1 running but a port is
#                                closed, 3 not running
#   scripts/rabbitmq.sh ctl ARGS rabbitmqctl against this node (e.g. "ctl list_queues")
#   scripts/rabbitmq.sh install  install Debian's rabbitmq-server if missing, start nothing
#                                (scripts/rabbitmq-cluster.sh installs through it)
#
# The node is Debian 12's rabbitmq-server (3.10), run as a private node "hafailover@localhost"
# that listens on 127.0.0.1 only and keeps everything (config, cookie, data, logs) under
# .data/rabbitmq/ in the project. It is not the Debian service: no systemd, no /var/lib/rabbitmq.
#
# Environment (all optional):
#   HAFAILOVER_RABBITMQ_AMQP_PORT      AMQP 0-9-1 and 1.0 port (5672)
#   HAFAILOVER_RABBITMQ_STOMP_PORT     STOMP port (61613)
#   HAFAILOVER_RABBITMQ_DIST_PORT      Erlang distribution port (AMQP port + 20000)
#   HAFAILOVER_RABBITMQ_DATA_DIR       where the node lives (<project>/.data/rabbitmq)
#   HAFAILOVER_RABBITMQ_START_TIMEOUT  seconds to wait for the ports (120)
#   HAFAILOVER_RABBITMQ_STOP_TIMEOUT   seconds to wait for the node to exit (60)
#   HAFAILOVER_RABBITMQ_INSTALL_TIMEOUT seconds for apt-get (900)
#
# Why the node is started from /usr/lib/rabbitmq/bin and not /usr/sbin: Debian's wrappers in
# /usr/sbin run as root via "su rabbitmq", cd to /var/lib/rabbitmq, write the startup log to
# /var/log/rabbitmq and make the CLI read the cookie from /var/lib/rabbitmq. We want none of that:
# the node and every CLI call here run as the calling user (root in CI) with HOME pointing at
# .data/rabbitmq/home, whose .erlang.cookie this script writes, so rabbitmqctl always finds the
# same cookie as the node whatever HOME the caller had. One such node per machine: its Erlang
# node name is fixed.
set -euo pipefail

readonly HOST=127.0.0.1
readonly NODENAME=hafailover@localhost
readonly RMQ_BIN=/usr/lib/rabbitmq/bin

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AMQP_PORT="${HAFAILOVER_RABBITMQ_AMQP_PORT:-5672}"
STOMP_PORT="${HAFAILOVER_RABBITMQ_STOMP_PORT:-61613}"
DIST_PORT="${HAFAILOVER_RABBITMQ_DIST_PORT:-}" # default set in main, once AMQP_PORT is checked
DATA="${HAFAILOVER_RABBITMQ_DATA_DIR:-$ROOT/.data/rabbitmq}"
START_TIMEOUT="${HAFAILOVER_RABBITMQ_START_TIMEOUT:-120}"
STOP_TIMEOUT="${HAFAILOVER_RABBITMQ_STOP_TIMEOUT:-60}"
INSTALL_TIMEOUT="${HAFAILOVER_RABBITMQ_INSTALL_TIMEOUT:-900}"

PID_FILE="$DATA/rabbitmq.pid"
CONF_FILE="$DATA/etc/rabbitmq.conf"
LOG_DIR="$DATA/log"
NODE_LOG="$LOG_DIR/$NODENAME.log"
STARTUP_LOG="$LOG_DIR/startup.log"
EPMD_MARK="$DATA/epmd.started-by-us"
CRASH_DUMP="$LOG_DIR/erl_crash.dump"

say() { printf 'rabbitmq.sh: %s\n' "$*" >&2; }

die() {
    say "ERROR: $*"
    exit 1
}

show_logs() {
    local f
    if [[ -s "$CRASH_DUMP" ]]; then
        say "the Erlang VM crashed: $(grep -m1 '^Slogan:' "$CRASH_DUMP" || true)"
    fi
    for f in "$STARTUP_LOG" "$NODE_LOG"; do
        if [[ -s "$f" ]]; then
            say "--- last 40 lines of $f ---"
            tail -n 40 "$f" >&2 || true
        fi
    done
}

check_port_number() {
    if ! [[ "$2" =~ ^[0-9]+$ ]] || ((10#$2 < 1 || 10#$2 > 65535)); then
        die "$1 must be a TCP port number, got '$2'"
    fi
}

# ---------------------------------------------------------------------------------------------
# environment of every RabbitMQ / Erlang command run here
# ---------------------------------------------------------------------------------------------
rmq_env() {
    export HOME="$DATA/home"
    export LANG=C.UTF-8 LC_ALL=C.UTF-8 # the Elixir CLI warns (and misbehaves) under latin1
    export RABBITMQ_NODENAME="$NODENAME"
    export RABBITMQ_USE_LONGNAME=false
    export RABBITMQ_NODE_IP_ADDRESS="$HOST"
    export RABBITMQ_NODE_PORT="$AMQP_PORT"
    export RABBITMQ_DIST_PORT="$DIST_PORT"
    export RABBITMQ_CONF_ENV_FILE="$DATA/etc/rabbitmq-env.conf" # not /etc/rabbitmq/rabbitmq-env.conf
    export RABBITMQ_CONFIG_FILE="$CONF_FILE"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$DATA/etc/advanced.config" # absent on purpose
    export RABBITMQ_ENABLED_PLUGINS_FILE="$DATA/etc/enabled_plugins"
    export RABBITMQ_MNESIA_BASE="$DATA/mnesia"
    export RABBITMQ_LOG_BASE="$LOG_DIR"
    export RABBITMQ_PID_FILE="$PID_FILE"
    # the distribution listeners (node and CLI) and epmd on loopback only
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export ERL_EPMD_ADDRESS="$HOST"
    export ERL_CRASH_DUMP="$CRASH_DUMP"
}

ctl() { # timeout-seconds args...
    local t="$1"
    shift
    (rmq_env && cd "$DATA" && timeout "$t" "$RMQ_BIN/rabbitmqctl" -n "$NODENAME" "$@" </dev/null)
}

write_files() {
    mkdir -p "$DATA/etc" "$DATA/home" "$DATA/mnesia" "$LOG_DIR"
    chmod 700 "$DATA/home"
    local cookie="$DATA/home/.erlang.cookie"
    if [[ ! -s "$cookie" ]]; then
        (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$cookie.tmp")
        mv "$cookie.tmp" "$cookie"
    fi
    chmod 400 "$cookie" # Erlang refuses a cookie file that others can read
    : >"$DATA/etc/rabbitmq-env.conf"
    # written to a temp file first: ensure compares it with the running node's
    cat >"$CONF_FILE.new" <<EOF
# written by scripts/rabbitmq.sh; edits are overwritten
listeners.tcp.1 = $HOST:$AMQP_PORT
stomp.listeners.tcp.1 = $HOST:$STOMP_PORT
loopback_users.guest = true
default_user = guest
default_pass = guest
stomp.default_user = guest
stomp.default_pass = guest
log.file.level = info
log.console = false
EOF
}

# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------
is_installed() {
    [[ -x "$RMQ_BIN/rabbitmq-server" ]] &&
        [[ "$(dpkg-query -W -f='${Status}' rabbitmq-server 2>/dev/null)" == "install ok installed" ]]
}

apt_quiet() { # apt-get ARGS: progress to the log, errors to stderr (minus known noise)
    DEBIAN_FRONTEND=noninteractive timeout "$INSTALL_TIMEOUT" apt-get "$@" </dev/null \
        2> >(grep -v '^debconf: delaying package configuration' >&2) >>"$LOG_DIR/apt.log"
}

apt_install() {
    apt_quiet install -y -q -o Dpkg::Options::=--force-confdef \
        -o Dpkg::Options::=--force-confold rabbitmq-server
}

install_rabbitmq() {
    is_installed && return 0
    [[ "$(id -u)" == 0 ]] || die "rabbitmq-server is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "rabbitmq-server is not installed and there is no apt-get"
    say "installing rabbitmq-server (Debian package)"
    # The package's postinst starts the Debian service through invoke-rc.d (all interfaces,
    # /var/lib/rabbitmq, port 5672 taken). A policy-rc.d that says 101 stops that; Docker-style
    # images ship one already, else one is put in place for the install only.
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\n# temporary, by hafailover scripts/rabbitmq.sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
        trap 'exit 130' INT TERM # so that the EXIT trap runs
    fi
    : >"$LOG_DIR/apt.log"
    local ok=""
    if apt_install; then
        ok=1
    else
        say "apt-get install failed; running apt-get update and trying again"
        if apt_quiet update -q && apt_install; then
            ok=1
        fi
    fi
    if [[ -n "$made_policy" ]]; then
        rm -f "$policy"
        trap - EXIT INT TERM
    fi
    if [[ -z "$ok" ]] || ! is_installed; then
        tail -n 20 "$LOG_DIR/apt.log" >&2 || true
        die "could not install rabbitmq-server (full apt output: $LOG_DIR/apt.log)"
    fi
}

# ---------------------------------------------------------------------------------------------
# node state
# ---------------------------------------------------------------------------------------------
node_pid() { # prints the pid of our node if it is alive, else fails
    [[ -s "$PID_FILE" ]] || return 1
    local pid
    pid="$(tr -dc '0-9' <"$PID_FILE")"
    [[ -n "$pid" ]] && alive "$pid" || return 1
    # guard against pid reuse: it must be the process this script started with this data dir
    # (3.10 sets the node name from Erlang, not on the command line; the environment has it)
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "RABBITMQ_PID_FILE=$PID_FILE" || return 1
    printf '%s\n' "$pid"
}

alive() { # a zombie (exited, not yet reaped by pid 1) counts as gone
    local st
    st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ -n "$st" && "$st" != Z* ]]
}

port_open() {
    # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$HOST" "$1" 2>/dev/null
}

port_owner() { ss -ltnpH "sport = :$1" 2>/dev/null | head -n 3; }

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

wait_ready() { # pid: waits for both ports, fails early if the node dies
    local pid="$1" deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        if [[ -n "$pid" ]] && ! alive "$pid"; then
            show_logs
            die "the RabbitMQ node (pid $pid) exited during start"
        fi
        if [[ -z "$pid" ]]; then
            pid="$(node_pid)" || pid=""
            # a VM that dies in early boot (bad config, name clash) leaves no pid, only a dump
            if [[ -z "$pid" && -s "$CRASH_DUMP" ]]; then
                show_logs
                die "the RabbitMQ node failed to boot"
            fi
        fi
        if [[ -n "$pid" ]] && port_open "$AMQP_PORT" && port_open "$STOMP_PORT"; then
            return 0
        fi
        sleep 0.5
    done
    show_logs
    die "RabbitMQ did not accept connections on $HOST:$AMQP_PORT (AMQP) and $HOST:$STOMP_PORT (STOMP) within ${START_TIMEOUT}s"
}

start_node() {
    local p
    for p in "$AMQP_PORT" "$STOMP_PORT" "$DIST_PORT"; do
        if port_open "$p"; then
            say "port $HOST:$p is in use by another process:"
            port_owner "$p" >&2 || true
            die "cannot start RabbitMQ: port $p is taken (set HAFAILOVER_RABBITMQ_*_PORT or stop that process)"
        fi
    done
    mv "$CONF_FILE.new" "$CONF_FILE"
    rm -f "$PID_FILE"
    [[ ! -e "$CRASH_DUMP" ]] || mv -f "$CRASH_DUMP" "$CRASH_DUMP.old"
    if epmd_up; then rm -f "$EPMD_MARK"; else : >"$EPMD_MARK"; fi
    # plugins are enabled offline, before the node starts: the file is read at boot (the CLI
    # takes ~2 s, so it runs only when the file does not already say so)
    [[ "$(cat "$DATA/etc/enabled_plugins" 2>/dev/null)" == "[rabbitmq_amqp1_0,rabbitmq_stomp]." ]] ||
    (rmq_env && cd "$DATA" &&
        "$RMQ_BIN/rabbitmq-plugins" enable --offline rabbitmq_stomp rabbitmq_amqp1_0 \
            </dev/null >"$LOG_DIR/plugins.log" 2>&1 9>&-) || {
        cat "$LOG_DIR/plugins.log" >&2
        die "rabbitmq-plugins enable --offline failed"
    }
    say "starting node $NODENAME (data in $DATA)"
    local t0=$SECONDS
    # 9>&-: the detached node (and epmd) must not inherit the lock, or the next call would wait
    (rmq_env && cd "$DATA" && "$RMQ_BIN/rabbitmq-server" -detached \
        </dev/null >"$STARTUP_LOG" 2>&1 9>&-) || {
        show_logs
        die "rabbitmq-server -detached failed"
    }
    wait_ready ""
    say "node $(node_pid) ready in $((SECONDS - t0))s"
}

stop_node() {
    local pid
    if ! pid="$(node_pid)"; then
        rm -f "$PID_FILE"
        say "not running"
        stop_epmd
        return 0
    fi
    say "stopping node $NODENAME (pid $pid)"
    # "stop <pidfile>" returns once the OS process has exited
    ctl "$STOP_TIMEOUT" stop "$PID_FILE" >>"$LOG_DIR/stop.log" 2>&1 ||
        say "rabbitmqctl stop failed or timed out (see $LOG_DIR/stop.log)"
    local deadline=$((SECONDS + 10))
    while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
    if alive "$pid"; then
        say "pid $pid still alive; sending SIGTERM"
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$((SECONDS + 15))
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
    fi
    if alive "$pid"; then
        say "pid $pid still alive; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    ! alive "$pid" || die "RabbitMQ node pid $pid did not exit"
    rm -f "$PID_FILE"
    stop_epmd
    local p
    for p in "$AMQP_PORT" "$STOMP_PORT"; do
        ! port_open "$p" || die "node pid $pid is gone but $HOST:$p still accepts connections"
    done
    say "stopped"
}

stop_epmd() {
    # epmd outlives the node; stop it only if our start launched it and no node is left in it
    [[ -e "$EPMD_MARK" ]] || return 0
    rm -f "$EPMD_MARK"
    local e
    e="$(epmd_bin)" || return 0
    if "$e" -names 2>/dev/null | grep -q '^name '; then
        return 0
    fi
    (export ERL_EPMD_ADDRESS="$HOST" && "$e" -kill >/dev/null 2>&1) || true
}

# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
cmd_ensure() {
    install_rabbitmq
    write_files
    local pid
    if pid="$(node_pid)"; then
        if cmp -s "$CONF_FILE" "$CONF_FILE.new"; then
            wait_ready "$pid"
            rm -f "$CONF_FILE.new"
            say "already running (pid $pid)"
        else
            say "configuration changed (ports?): restarting"
            mv "$CONF_FILE.new" "$CONF_FILE.want"
            stop_node
            mv "$CONF_FILE.want" "$CONF_FILE.new"
            start_node
        fi
    else
        start_node
    fi
    printf 'rabbitmq: stomp %s:%s amqp %s:%s\n' "$HOST" "$STOMP_PORT" "$HOST" "$AMQP_PORT"
}

cmd_stop() {
    [[ -d "$DATA" ]] || {
        say "not running (no $DATA)"
        return 0
    }
    stop_node
}

cmd_status() {
    local pid
    if pid="$(node_pid)"; then
        local amqp=closed stomp=closed
        port_open "$AMQP_PORT" && amqp=open
        port_open "$STOMP_PORT" && stomp=open
        printf 'rabbitmq: running node %s pid %s stomp %s:%s (%s) amqp %s:%s (%s)\n' \
            "$NODENAME" "$pid" "$HOST" "$STOMP_PORT" "$stomp" "$HOST" "$AMQP_PORT" "$amqp"
        [[ "$amqp" == open && "$stomp" == open ]] || return 1
    else
        printf 'rabbitmq: not running (installed: %s)\n' "$(is_installed && echo yes || echo no)"
        return 3
    fi
}

main() {
    local cmd="${1:-}"
    check_port_number HAFAILOVER_RABBITMQ_AMQP_PORT "$AMQP_PORT"
    check_port_number HAFAILOVER_RABBITMQ_STOMP_PORT "$STOMP_PORT"
    DIST_PORT="${DIST_PORT:-$((10#$AMQP_PORT + 20000))}"
    check_port_number HAFAILOVER_RABBITMQ_DIST_PORT "$DIST_PORT"
    case "$cmd" in
        ensure | stop | install)
            mkdir -p "$DATA" "$LOG_DIR"
            # one ensure/stop at a time (parallel test sessions)
            exec 9>"$DATA/.lock"
            flock -w "$((INSTALL_TIMEOUT + START_TIMEOUT))" 9 || die "another rabbitmq.sh holds $DATA/.lock"
            if [[ "$cmd" == install ]]; then install_rabbitmq; else "cmd_$cmd"; fi
            ;;
        status) cmd_status ;;
        ctl)
            shift
            [[ -s "$DATA/home/.erlang.cookie" ]] || die "no node set up in $DATA (run ensure)"
            ctl "$STOP_TIMEOUT" "$@"
            ;;
        *)
            echo "usage: $0 ensure|stop|status|install|ctl ARGS..." >&2
            exit 2
            ;;
    esac
}

main "$@"
