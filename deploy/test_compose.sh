#!/usr/bin/env bash
# Builds the images and runs deploy/docker-compose.yml for real, then checks the
# stack from this host through the published gateway port (deploy/compose_checks.py):
# a templated streaming request, greedy outputs equal to transformers' generate, the
# engine container killed and recovering, Redis restarted with its templates kept.
# Everything it made (containers, volumes, images, build cache, processes) is removed
# at the end, however it ends, so a second run starts as cold as the first.
#
#   deploy/test_compose.sh        # as root; .ci/run calls it after `make test`
#
# Containers run with podman (Debian's), through its Docker-compatible socket, driven
# by PyPI's docker-compose 1.29 (`make setup` puts it in .venv/compose). Where Docker
# Hub cannot be reached, the bases are built here from Debian's packages (mmdebstrap):
# python:3.11-slim is replaced by a Debian base with python3 (a build argument), and
# redis:7 by deploy/Dockerfile.redis (KVD_REDIS_IMAGE). pip's configuration of this
# host (CA bundle, local find-links and indexes) is mounted into the build only.
#
# Knobs (environment): COMPOSE_TEST_PROJECT (compose project name, default kvdci),
# COMPOSE_TEST_PORT (the gateway's published port, default 50061),
# COMPOSE_TEST_PULL_TIMEOUT (seconds to try pulling an official base, default 20),
# COMPOSE_TEST_KEEP_IMAGES=1 (keep the images and their layers: a rerun builds from them).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PROJECT=${COMPOSE_TEST_PROJECT:-kvdci}
PORT=${COMPOSE_TEST_PORT:-50061}
PULL_TIMEOUT=${COMPOSE_TEST_PULL_TIMEOUT:-20}
PY=$ROOT/.venv/bin/python
COMPOSE_BIN=$ROOT/.venv/compose/bin/docker-compose
# Every image this script builds or pulls is named under TAG, and every image it
# builds (intermediate layers too) carries LABEL, so the teardown finds them all.
TAG=localhost/$PROJECT
LABEL=org.kvd.compose-test=$PROJECT
WORK=$(mktemp -d /tmp/kvd-compose.XXXXXX)
REDIS_IMAGE=redis:7 # or the stand-in, once built
BUILD_S="" UP_S=""
SERVICE_PID=""
TICKER_PID=""
STARTED=$(date +%s)

log() { printf '[%s +%4ss] %s\n' "$(date -u +%T)" "$(($(date +%s) - STARTED))" "$*" >&2; }

# ------------------------------------------------------------------ tools

install_tools() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (apt)"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
    fi
    [[ -x $COMPOSE_BIN && -x $PY ]] || make setup
    # A compose virtualenv made before the Makefile pinned docker-py (see COMPOSE_SPEC).
    "${COMPOSE_BIN%/*}/python" -c "import docker, sys; sys.exit(int(docker.__version__.split('.')[0]) >= 7)" ||
        "${COMPOSE_BIN%/*}/python" -m pip install -q 'docker>=6.1,<7' 'requests<2.32'
}

# podman's settings for this run only, in a file of its own (CONTAINERS_CONF), so a
# user's containers.conf is left alone: runc (crun refuses some hosts' cgroup
# layouts) and rlimits no higher than the host's hard ones (podman's default
# nofile=1048576 fails where root lacks CAP_SYS_RESOURCE).
write_containers_conf() {
    local nofile nproc
    nofile=$(ulimit -Hn) nproc=$(ulimit -Hu)
    [[ $nofile == unlimited || $nofile -gt 20000 ]] && nofile=20000
    [[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
    cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
events_logger = "file"
EOF
    export CONTAINERS_CONF=$WORK/containers.conf
}

# The Docker-compatible API that docker-compose talks to.
start_podman_service() {
    podman system service --time=0 "unix://$WORK/podman.sock" >"$WORK/podman-service.log" 2>&1 &
    SERVICE_PID=$!
    export DOCKER_HOST=unix://$WORK/podman.sock
    for _ in $(seq 50); do
        [[ -S $WORK/podman.sock ]] && return
        sleep 0.2
    done
    log "podman system service did not start:" && cat "$WORK/podman-service.log" >&2 && return 1
}

compose() {
    KVD_IMAGE=$TAG/kvd:cpu KVD_REDIS_IMAGE=$REDIS_IMAGE KVD_GATEWAY_PORT=$PORT \
        "$COMPOSE_BIN" -p "$PROJECT" -f deploy/docker-compose.yml "$@"
}

# ------------------------------------------------------------------ images

# Writes pip's configuration of this host to $WORK/pip.conf and prints the podman
# --volume flags that show it, and every local path it names, to a build (read-only,
# at the same paths; nothing mounted is committed to an image).
pip_build_mounts() {
    python3 - "$WORK/pip.conf" <<'EOF'
import configparser, os, shlex, subprocess, sys
lines = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
conf = configparser.ConfigParser()
conf["global"] = {}
paths = set()
for line in lines.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section not in ("global", ":env:", "install"):
        continue
    value = value.strip().strip("'\"")
    conf["global"][name] = value
    for word in value.split():
        path = word.removeprefix("file://").rstrip("/")
        if word.startswith("file://") and path.endswith("/simple"):
            path = os.path.dirname(path)  # a local index: its files lie beside simple/
        if path.startswith("/") and os.path.exists(path):
            paths.add(os.path.realpath(path) if os.path.isfile(path) else path)
with open(sys.argv[1], "w") as out:
    conf.write(out)
print(f"--volume={sys.argv[1]}:/etc/pip.conf:ro")
for path in sorted(paths):
    print(f"--volume={path}:{path}:ro")
EOF
}

# Pulls IMAGE within the time limit (true if it is here afterwards), noting it for
# the teardown unless it was here before.
try_pull() {
    podman image exists "$1" && return 0
    timeout "$PULL_TIMEOUT" podman pull -q "$1" >/dev/null 2>&1 && echo "$1" >>"$WORK/pulled"
}

# A Debian base with python3 (and venv), from Debian's packages, as a local image.
build_debian_base() {
    podman image exists "$TAG/debian-base:bookworm" && return 0 # kept (COMPOSE_TEST_KEEP_IMAGES)
    log "building a Debian base with mmdebstrap"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --format=tar bookworm "$WORK/base.tar" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
    podman import -q --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' --change "LABEL $LABEL" \
        "$WORK/base.tar" "$TAG/debian-base:bookworm" >/dev/null
    rm -f "$WORK/base.tar"
}

build_images() {
    local base=python:3.11-slim build_args=() mounts=()
    if try_pull "$base"; then
        log "pulled $base"
    else
        log "$base cannot be pulled within ${PULL_TIMEOUT}s"
        build_debian_base
        base=$TAG/debian-base:bookworm
    fi
    if try_pull redis:7; then
        log "pulled redis:7"
    else
        log "redis:7 cannot be pulled: building deploy/Dockerfile.redis (Debian's redis-server)"
        REDIS_IMAGE=$TAG/redis:debian
        podman build -q --layers --label "$LABEL" --build-arg "BASE_IMAGE=$base" -f deploy/Dockerfile.redis \
            -t "$REDIS_IMAGE" deploy >"$WORK/build-redis.log" 2>&1 || { tail -20 "$WORK/build-redis.log" >&2; return 1; }
    fi
    build_args=(--build-arg "PYTHON_IMAGE=$base")
    if ! timeout 15 python3 -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=10)" 2>/dev/null; then
        log "the PyTorch CPU index cannot be reached: torch comes from pip's configuration"
        build_args+=(--build-arg TORCH_INDEX=)
    fi
    mapfile -t mounts < <(pip_build_mounts)
    build_args+=(--layers --label "$LABEL" -f "$ROOT/deploy/Dockerfile")
    # The context: a snapshot of what the image takes (Dockerfile.dockerignore's
    # list), so that both builds below see the same files while the tree may change.
    mkdir "$WORK/context"
    tar -C "$ROOT" --exclude=__pycache__ -cf - $(sed -n 's/^!//p' deploy/Dockerfile.dockerignore) |
        tar -C "$WORK/context" -xf -
    log "building deploy/Dockerfile (base $base)"
    local t0=$SECONDS
    # The build stage with pip's configuration mounted; then the whole image without
    # (the build stage comes from the layers just made), so the final stage's steps
    # leave no mount point behind in the image.
    podman build "${build_args[@]}" "${mounts[@]}" --target build -t "$TAG/kvd:build" "$WORK/context" \
        >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; return 1; }
    podman build "${build_args[@]}" -t "$TAG/kvd:cpu" "$WORK/context" >>"$WORK/build.log" 2>&1 ||
        { tail -40 "$WORK/build.log" >&2; return 1; }
    BUILD_S=$((SECONDS - t0))
    # The layer order at work: a code change (a comment added to one module of the
    # snapshot) must rebuild only the last steps. Its image is not the one served.
    echo "# a code change (deploy/test_compose.sh)" >>"$WORK/context/kvd/__init__.py"
    t0=$SECONDS
    podman build "${build_args[@]}" -t "$TAG/kvd:changed" "$WORK/context" >"$WORK/rebuild.log" 2>&1 ||
        { tail -40 "$WORK/rebuild.log" >&2; return 1; }
    REBUILD_S=$((SECONDS - t0))
    # Steps run again (not "Using cache"); the expensive ones must not be among them.
    local ran
    ran=$(awk '/STEP [0-9]+\/[0-9]+: / {if (step != "" && !cached) print step; step = $0; cached = 0}
               /^--> Using cache/ {cached = 1}
               END {if (step != "" && !cached) print step}' "$WORK/rebuild.log" |
        grep -E 'STEP [0-9/]+: (RUN|COPY)' | sed -E 's/.*STEP [0-9/]+: //' | cut -c1-90)
    log "kvd image built in ${BUILD_S}s; after a code change built again in ${REBUILD_S}s," \
        "running again only:"$'\n'"$(sed 's/^/    /' <<<"$ran")"
    if grep -qE 'TORCH_SPEC|requirements|MODEL_PACKAGE|/opt/kvd/venv' <<<"$ran"; then
        log "a code change reinstalled dependencies: the layer order is broken" && return 1
    fi
    report_image
}

report_image() {
    local image=$TAG/kvd:cpu
    log "image $image: $(podman image inspect -f '{{.Size}}' "$image" | numfmt --to=iec) in all"
    log "its largest layers (podman history):"
    podman history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | sed -E 's/^([0-9.]+) ([kMG]?)B/\1\2/' |
        sort -h -r | head -4 |
        cut -c1-150 | sed 's/^/    /' >&2
    log "the largest installed packages (site-packages):"
    podman run --rm --entrypoint sh "$image" -c \
        'cd /opt/kvd/venv/lib/python3*/site-packages && du -s -m * | sort -n -r | head -6' |
        sed 's/^/    MiB /' >&2
    podman run --rm --entrypoint sh "$image" -c \
        'du -s -m /opt/kvd/models /usr /opt/kvd/venv | sed "s/^/    MiB /"' >&2
}

# ------------------------------------------------------------------ the stack

# podman runs healthchecks from systemd timers; without systemd (a container, a CI
# runner) nothing runs them, so this loop does, as the timers would.
start_health_ticker() {
    while sleep 5; do
        for id in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null); do
            podman healthcheck run "$id" >/dev/null 2>&1 || true
        done
    done &
    TICKER_PID=$!
}

wait_healthy() {
    local deadline=$((SECONDS + $1)) states
    while ((SECONDS < deadline)); do
        states=$(podman ps -a --filter "label=com.docker.compose.project=$PROJECT" \
            --format '{{index .Labels "com.docker.compose.service"}}={{.Status}}')
        if [[ -n $states ]] && ! grep -qv '(healthy)' <<<"$states"; then
            log "all healthy: $(tr '\n' ' ' <<<"$states")"
            return 0
        fi
        sleep 3
    done
    log "not healthy after $1 s:"$'\n'"$states"
    return 1
}

stack_up() {
    log "compose up"
    local t0=$SECONDS
    # docker-compose waits for each service's depends_on (service_healthy) itself.
    compose up -d --no-build >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; return 1; }
    wait_healthy 300
    UP_S=$((SECONDS - t0))
    log "stack up and healthy in ${UP_S}s"
}

dump_logs() {
    log "container logs (last lines of each):"
    for id in $(podman ps -a -q --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null); do
        echo "--- $(podman inspect -f '{{.Name}} {{.State.Status}}' "$id")" >&2
        podman logs --tail 25 "$id" >&2 2>&1 || true
    done
}

# ------------------------------------------------------------------ teardown

stop_process() {
    [[ -n $1 ]] && kill "$1" 2>/dev/null && wait "$1" 2>/dev/null || true
}

teardown() {
    [[ -n ${CONTAINERS_CONF:-} ]] || return 0
    if [[ -S ${DOCKER_HOST#unix://} ]]; then
        compose down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    fi
    stop_process "$TICKER_PID"
    TICKER_PID=""
    # Whatever compose left (an aborted run): its containers, volumes, networks.
    local label="label=com.docker.compose.project=$PROJECT"
    podman ps -a -q --filter "$label" | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
    podman volume ls -q --filter "$label" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
    podman network ls -q --filter "$label" | xargs -r podman network rm -f >/dev/null 2>&1 || true
    [[ ${COMPOSE_TEST_KEEP_IMAGES:-} == 1 ]] && return 0
    # The images this script built or pulled, and their layers (the build cache).
    podman images -a -q --filter "label=$LABEL" | xargs -r podman rmi -f >/dev/null 2>&1 || true
    { podman images --format '{{.Repository}}:{{.Tag}}' | grep "^$TAG/" || true
      cat "$WORK/pulled" 2>/dev/null || true; } | xargs -r podman rmi -f >/dev/null 2>&1 || true
}

cleanup() {
    local rc=$?
    set +e # tear down as much as can be, whatever fails
    ((rc == 0)) || dump_logs || true
    log "teardown"
    teardown
    stop_process "$SERVICE_PID"
    rm -rf "$WORK"
    log "$( ((rc == 0)) && echo passed || echo "FAILED (exit $rc)") in $(($(date +%s) - STARTED))s"
    exit "$rc"
}

main() {
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    install_tools
    write_containers_conf
    start_podman_service
    teardown # what an aborted earlier run may have left
    build_images
    start_health_ticker
    stack_up
    "$PY" deploy/compose_checks.py --gateway "127.0.0.1:$PORT" --project "$PROJECT"
    log "checks passed; build ${BUILD_S}s, stack up ${UP_S}s"
}

main "$@"
