#!/usr/bin/env bash
# Install a working CRIU (>= 4.1) on this node.
#
#   1. criu >= 4.1 already on PATH (or at /usr/local/sbin/criu): only run `criu check`.
#   2. the distro's candidate package is >= 4.1 (Debian 13+): `apt-get install criu`.
#   (1 and 2 also require that the criu can dump a process with an inet socket: stock CRIU <= 4.1.1
#   cannot on Linux >= 6.16; then, as in 3, a build with scripts/criu-patches/*.patch is made.)
#   3. otherwise (Debian 12: its criu 3.17 fails on recent kernels with
#      "Unexpected rt vDSO area bounds"): build the criu binary from the
#      upstream tarball that Debian ${CRIU_SOURCE_SUITE:-trixie} ships, fetched
#      from the same Debian mirror this machine's apt sources already use, and
#      install it to /usr/local/sbin/criu. The chain of trust is:
#      dists/<suite>/InRelease (gpgv, debian-archive-keyring) -> sha256 of
#      main/source/Sources.xz -> sha256 of criu_<ver>.orig.tar.*.
#      The system's apt sources are never modified.
#
# Finally runs `criu check`; exits non-zero if it fails.
#
# Environment overrides:
#   CRIU_SOURCE_SUITE  Debian suite to take the source from (default: trixie)
#   CRIU_MIRROR        Debian archive base URL (default: read from apt sources)
#   JOBS               parallel make jobs (default: nproc)
#   CRIU_VERSION       build exactly this upstream version (e.g. 4.2.1) from the first suite that has it:
#                      CRIU_SOURCE_SUITE if set, else trixie, forky, sid. Its patches are
#                      scripts/criu-patches/<version>/*.patch if that folder exists, else the default set.
#   CRIU_PREFIX        install to $CRIU_PREFIX/sbin/criu (stamp in $CRIU_PREFIX/share/memsnap/) instead of
#                      /usr/local/sbin/criu, always from source (steps 1 and 2 are skipped, and the criu
#                      on PATH is left alone). E.g. CRIU_VERSION=4.2.1 CRIU_PREFIX=/opt/criu-4.2.1; point
#                      MEMSNAP_CRIU at $CRIU_PREFIX/sbin/criu to use it.
#
# Needs root. crit / pycriu are not built (memsnap does not need them).
set -euo pipefail

MIN_VERSION=4.1
WANT_VERSION=${CRIU_VERSION:-}
PREFIX=${CRIU_PREFIX:-}
INSTALL_PATH=${PREFIX:+$PREFIX/sbin/criu}
INSTALL_PATH=${INSTALL_PATH:-/usr/local/sbin/criu}
if [[ -n ${CRIU_SOURCE_SUITE:-} || -z $WANT_VERSION ]]; then
    SOURCE_SUITES=("${CRIU_SOURCE_SUITE:-trixie}")
else
    SOURCE_SUITES=(trixie forky sid)
fi
JOBS=${JOBS:-$(nproc)}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

# Minimal set that builds the criu binary (required: protobuf-c, libnl-3,
# libnet, libcap, uuid; libprotobuf-dev provides google/protobuf/descriptor.proto;
# libbsd-dev is optional but gives setproctitle()). Optional features that are
# picked up automatically if their -dev package happens to be installed:
# gnutls (TLS page server), libnftables (nft network locking), libdrm (amdgpu).
BUILD_DEPS=(
    build-essential pkg-config patch
    libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler
    libnl-3-dev libnet1-dev libcap-dev uuid-dev libbsd-dev
    libnftables-dev
)
# libnftables-dev: nftables network locking for --tcp-established (the iptables lock needs legacy tables).
# criu >= 4.2 generates its protobuf code with `protoc --c_out` (protobuf-c's protoc-gen-c plugin), not protoc-c.
if [[ -n $WANT_VERSION ]] && dpkg --compare-versions "$WANT_VERSION" ge 4.2; then
    BUILD_DEPS+=(protobuf-compiler)
fi

# Fixes memsnap needs on top of the upstream release (see scripts/criu-patches/README.md). A build
# carries a stamp of the patch set it was made with; a different stamp means "rebuild".
PATCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/criu-patches
[[ -n $WANT_VERSION && -d $PATCH_DIR/$WANT_VERSION ]] && PATCH_DIR=$PATCH_DIR/$WANT_VERSION
STAMP_FILE=${PREFIX:-/usr/local}/share/memsnap/criu-build.stamp
patch_stamp() {
    { echo "min=$MIN_VERSION deps=${BUILD_DEPS[*]}"; [[ -z $WANT_VERSION ]] || echo "version=$WANT_VERSION"
      cat "$PATCH_DIR"/*.patch 2>/dev/null; } | sha256sum | cut -d' ' -f1
}

# Functional probe: can this criu dump a process holding an inet socket? Stock CRIU <= 4.1.1 cannot on
# Linux >= 6.16 ("Can't get 1:34 opt: Operation not supported"), which breaks every networked job.
dumps_inet_sockets() {
    local bin=$1 dir pid rc=0
    dir=$(mktemp -d /tmp/criu-probe.XXXXXX)
    unshare --pid --fork -- setsid -- python3 -c \
        'import socket,time; s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); time.sleep(60)' \
        </dev/null >/dev/null 2>&1 &
    local launcher=$!
    for _ in $(seq 50); do pid=$(pgrep -P "$launcher" | head -n1); [[ -n $pid ]] && break; sleep 0.1; done
    sleep 0.3
    "$bin" dump -t "$pid" -D "$dir" --leave-running -o dump.log >/dev/null 2>&1 || rc=$?
    [[ $rc -ne 0 ]] && grep -h "Error" "$dir/dump.log" 2>/dev/null | grep -v RLIMIT_NOFILE | tail -n 2 >&2
    kill -9 "$pid" "$launcher" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
    rm -rf "$dir"
    return $rc
}

export DEBIAN_FRONTEND=noninteractive
export LC_ALL=C

log() { echo "install-criu: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Print the version reported by `<bin> --version` ("Version: 4.1.1"), or nothing.
criu_version() {
    "$1" --version 2>/dev/null | awk '/^Version:/ { print $2; exit }' || true
}

version_ge() { dpkg --compare-versions "$1" ge "$2"; }

# Run `<bin> check`; the RLIMIT_NOFILE complaint CRIU prints on some hosts is
# noise, so it is filtered out. The exit status decides.
run_check() {
    local bin=$1 out rc=0
    out=$("$bin" check 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -v 'RLIMIT_NOFILE' >&2 || true
    if [[ $rc -ne 0 ]]; then
        die "'$bin check' failed (exit $rc)"
    fi
    log "$bin: version $(criu_version "$bin"), 'criu check' OK"
}

fetch() { # url dest
    if command -v curl >/dev/null 2>&1; then
        curl -fsSL --retry 3 --connect-timeout 20 -o "$2" "$1"
    elif command -v wget >/dev/null 2>&1; then
        wget -q --tries=3 --timeout=20 -O "$2" "$1"
    else
        die "neither curl nor wget is installed"
    fi
}

# Print the Debian archive base URI(s) that serve <codename> main, from the
# machine's own apt sources (deb822 *.sources and one-line *.list files).
# Entries for other suites (e.g. <codename>-security, -updates) don't match.
debian_mirrors() {
    local codename=$1 f
    local -a files=()
    [[ -f /etc/apt/sources.list ]] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] && files+=("$f")
    done
    [[ ${#files[@]} -gt 0 ]] || return 0
    for f in "${files[@]}"; do
        if [[ $f == *.sources ]]; then
            # deb822: blank-line separated stanzas of "Key: value" fields.
            awk -v want="$codename" '
                function flush(   n, i, s, okt, oks, okc) {
                    if (uris != "" && tolower(enabled) != "no") {
                        n = split(types, s, /[ \t]+/); okt = 0
                        for (i = 1; i <= n; i++) if (s[i] == "deb" || s[i] == "deb-src") okt = 1
                        n = split(suites, s, /[ \t]+/); oks = 0
                        for (i = 1; i <= n; i++) if (s[i] == want) oks = 1
                        n = split(comps, s, /[ \t]+/); okc = 0
                        for (i = 1; i <= n; i++) if (s[i] == "main") okc = 1
                        if (okt && oks && okc) {
                            n = split(uris, s, /[ \t]+/)
                            for (i = 1; i <= n; i++) if (s[i] != "") print s[i]
                        }
                    }
                    types = suites = comps = uris = enabled = ""; last = ""
                }
                /^[ \t]*#/ { next }
                /^[ \t]*$/ { flush(); next }
                /^[ \t]/ {   # continuation line of a multi-line field
                    if (last == "uris") uris = uris " " $0
                    else if (last == "suites") suites = suites " " $0
                    else if (last == "components") comps = comps " " $0
                    next
                }
                {
                    key = tolower($0); sub(/:.*/, "", key)
                    val = $0; sub(/^[^:]*:[ \t]*/, "", val)
                    last = key
                    if (key == "types") types = val
                    else if (key == "uris") uris = val
                    else if (key == "suites") suites = val
                    else if (key == "components") comps = val
                    else if (key == "enabled") enabled = val
                }
                END { flush() }
            ' "$f"
        else
            # one-line: deb [options] URI suite component...
            awk -v want="$codename" '
                /^[ \t]*#/ { next }
                $1 == "deb" || $1 == "deb-src" {
                    line = $0
                    sub(/^[ \t]*deb(-src)?[ \t]+/, "", line)
                    sub(/^\[[^]]*\][ \t]*/, "", line)
                    n = split(line, w, /[ \t]+/)
                    if (n < 3 || w[2] != want) next
                    for (i = 3; i <= n; i++) if (w[i] == "main") { print w[1]; break }
                }
            ' "$f"
        fi
    done
}

# Print "<version>\t<directory>\t<sha256>\t<size>\t<filename>" for the criu
# orig tarball from a (decompressed) Debian Sources index on stdin.
parse_sources() {
    awk '
        function flush() {
            if (pkg == "criu" && !extra && ver != "" && file != "" && !done) {
                printf "%s\t%s\t%s\t%s\t%s\n", ver, dir, sum, size, file
                done = 1
            }
            pkg = ver = dir = sum = size = file = ""; extra = 0; insums = 0
        }
        /^$/ { flush(); next }
        /^Package:/ { pkg = $2; next }
        /^Version:/ { ver = $2; next }
        /^Directory:/ { dir = $2; next }
        /^Extra-Source-Only:[ \t]*yes/ { extra = 1; next }
        /^Checksums-Sha256:/ { insums = 1; next }
        /^[^ \t]/ { insums = 0; next }
        insums && $3 ~ /^criu_[^-]*\.orig\.tar\.(xz|gz|bz2)$/ { sum = $1; size = $2; file = $3 }
        END { flush() }
    '
}

# Fetch <suite>'s verified Sources index into <tmp> and print the criu line of parse_sources, or nothing.
suite_criu_source() { # mirror suite tmp
    local mirror=$1 suite=$2 tmp=$3
    # 1. Signed release file -> expected sha256 of the Sources index.
    fetch "$mirror/dists/$suite/InRelease" "$tmp/InRelease"
    gpgv --quiet --keyring "$KEYRING" --output "$tmp/Release" "$tmp/InRelease" 2>"$tmp/gpgv.log" \
        || { cat "$tmp/gpgv.log" >&2; die "InRelease signature verification failed"; }
    local sources_sha
    sources_sha=$(awk '/^SHA256:/ { s = 1; next } /^[^ ]/ { s = 0 }
                       s && $3 == "main/source/Sources.xz" { print $1; exit }' "$tmp/Release")
    [[ -n $sources_sha ]] || die "main/source/Sources.xz not listed in $suite InRelease"

    # 2. Sources index -> criu version, pool directory, orig tarball sha256.
    fetch "$mirror/dists/$suite/main/source/Sources.xz" "$tmp/Sources.xz"
    echo "$sources_sha  $tmp/Sources.xz" | sha256sum --check --quiet --strict \
        || die "sha256 mismatch for $suite main/source/Sources.xz"
    xz -dc "$tmp/Sources.xz" | parse_sources
}

build_from_source() {
    local codename mirror tmp
    # shellcheck disable=SC1091
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [[ -n $codename ]] || die "cannot determine distro codename from /etc/os-release"

    if [[ -n ${CRIU_MIRROR:-} ]]; then
        mirror=$CRIU_MIRROR
    else
        mirror=$(debian_mirrors "$codename" | grep -E '^https?://' | head -n1 || true)
        [[ -n $mirror ]] || die "no http(s) apt source serving '$codename main' found in /etc/apt; set CRIU_MIRROR"
    fi
    mirror=${mirror%/}
    log "using Debian mirror from apt sources: $mirror (source suites: ${SOURCE_SUITES[*]})"

    command -v gpgv >/dev/null 2>&1 || die "gpgv not found (needed to verify the suites' InRelease)"
    [[ -r $KEYRING ]] || die "$KEYRING missing (install debian-archive-keyring)"

    tmp=$(mktemp -d /tmp/install-criu.XXXXXX)
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    local info="" ver dir sum size file upver SOURCE_SUITE
    for SOURCE_SUITE in "${SOURCE_SUITES[@]}"; do
        info=$(suite_criu_source "$mirror" "$SOURCE_SUITE" "$tmp")
        [[ -n $info ]] || { log "no criu source package in $SOURCE_SUITE"; continue; }
        IFS=$'\t' read -r ver dir sum size file <<<"$info"
        upver=${ver#*:}
        upver=${upver%-*}
        log "$SOURCE_SUITE has criu $ver ($file, $size bytes, sha256 $sum)"
        [[ -z $WANT_VERSION || $upver == "$WANT_VERSION" ]] && break
        info=""
    done
    [[ -n $info ]] || die "no criu ${WANT_VERSION:-source package} in ${SOURCE_SUITES[*]}"
    version_ge "$upver" "$MIN_VERSION" || die "$SOURCE_SUITE criu $upver is older than $MIN_VERSION"

    # 3. Tarball, verified against the Sources index.
    fetch "$mirror/$dir/$file" "$tmp/$file"
    if ! echo "$sum  $tmp/$file" | sha256sum --check --quiet --strict; then
        die "sha256 MISMATCH for $file: expected $sum, got $(sha256sum "$tmp/$file" | cut -d' ' -f1)"
    fi
    mkdir "$tmp/src"
    tar -xf "$tmp/$file" -C "$tmp/src" --strip-components=1

    # 4. Build deps (from the running distro) and the criu binary only.
    log "installing build dependencies: ${BUILD_DEPS[*]}"
    if ! apt-get install -y --no-install-recommends "${BUILD_DEPS[@]}" >"$tmp/apt.log" 2>&1; then
        apt-get update >"$tmp/apt.log" 2>&1 || { cat "$tmp/apt.log" >&2; die "apt-get update failed"; }
        apt-get install -y --no-install-recommends "${BUILD_DEPS[@]}" >"$tmp/apt.log" 2>&1 \
            || { tail -n 30 "$tmp/apt.log" >&2; die "installing build dependencies failed"; }
    fi
    local p
    for p in "$PATCH_DIR"/*.patch; do
        [[ -e $p ]] || continue
        log "applying $(basename "$p")"
        patch -d "$tmp/src" -p1 --forward --quiet <"$p" || die "patch $(basename "$p") does not apply to criu $upver"
    done
    log "building criu $upver (make -j$JOBS criu)"
    local t0=$SECONDS
    if ! make -C "$tmp/src" -j"$JOBS" criu >"$tmp/build.log" 2>&1; then
        tail -n 40 "$tmp/build.log" >&2
        die "criu build failed"
    fi
    log "build finished in $((SECONDS - t0)) s"
    local built="$tmp/src/criu/criu" bver
    bver=$(criu_version "$built")
    if [[ -z $bver ]] || ! version_ge "$bver" "$MIN_VERSION"; then
        die "built binary reports version '${bver}'"
    fi

    install -D -m 0755 -o root -g root "$built" "$INSTALL_PATH"
    mkdir -p "$(dirname "$STAMP_FILE")"
    patch_stamp >"$STAMP_FILE"
    log "installed $INSTALL_PATH ($bver, patches: $(ls "$PATCH_DIR"/*.patch 2>/dev/null | wc -l))"

    # The binary links against runtime libs that apt only pulled in as
    # dependencies of the -dev packages; pin them so an autoremove after the
    # -dev packages are removed cannot break criu.
    local lib pkg
    local -a libpkgs=()
    while read -r lib; do
        pkg=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "/usr$lib" 2>/dev/null || dpkg -S "${lib#/usr}" 2>/dev/null || true)
        pkg=${pkg%%:*}
        [[ -n $pkg ]] && libpkgs+=("$pkg")
    done < <(ldd "$INSTALL_PATH" | awk '$3 ~ /^\// { print $3 }')
    if [[ ${#libpkgs[@]} -gt 0 ]]; then
        apt-mark manual "${libpkgs[@]}" >/dev/null || true
    fi

    rm -rf "$tmp"
    trap - EXIT
}

main() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"

    # Serialise concurrent runs (e.g. parallel provisioning).
    exec 9>/var/lock/memsnap-install-criu.lock
    flock 9

    local bin ver
    # 1. Already installed? Our own build with the current patch set is used as is; any other
    #    criu >= MIN_VERSION is used if it passes the inet-socket probe.
    if [[ -x $INSTALL_PATH && -f $STAMP_FILE && $(cat "$STAMP_FILE") == "$(patch_stamp)" ]]; then
        log "criu $(criu_version "$INSTALL_PATH") already built by memsnap at $INSTALL_PATH (patch set current)"
        run_check "$INSTALL_PATH"
        return 0
    fi
    # A chosen version or prefix is always our own build (1 and 2 would take whatever criu is there).
    if [[ -n $PREFIX || -n $WANT_VERSION ]]; then
        log "building criu ${WANT_VERSION:-from ${SOURCE_SUITES[*]}} into $INSTALL_PATH"
    else
        for bin in "$(command -v criu 2>/dev/null || true)" "$INSTALL_PATH"; do
            [[ -n $bin && -x $bin ]] || continue
            ver=$(criu_version "$bin")
            if [[ -n $ver ]] && version_ge "$ver" "$MIN_VERSION"; then
                if dumps_inet_sockets "$bin"; then
                    log "criu $ver already installed at $bin"
                    run_check "$bin"
                    return 0
                fi
                log "criu $ver at $bin cannot dump inet sockets on this kernel: building a patched one"
                continue
            fi
            log "found criu ${ver:-<unknown version>} at $bin: too old (need >= $MIN_VERSION)"
        done

        # 2. Distro package new enough?
        local cand
        cand=$(apt-cache policy criu 2>/dev/null | awk '/Candidate:/ { print $2; exit }')
        if [[ -z $cand || $cand == "(none)" ]]; then
            apt-get update >/dev/null
            cand=$(apt-cache policy criu 2>/dev/null | awk '/Candidate:/ { print $2; exit }')
        fi
        if [[ -n $cand && $cand != "(none)" ]] && version_ge "$cand" "$MIN_VERSION"; then
            log "installing distro package criu $cand"
            apt-get install -y criu
            if dumps_inet_sockets "$(command -v criu || echo /usr/sbin/criu)"; then
                run_check "$(command -v criu || echo /usr/sbin/criu)"
                return 0
            fi
            log "distro criu $cand cannot dump inet sockets on this kernel: building a patched one"
        fi
        log "distro candidate criu ${cand:-none} < $MIN_VERSION: building from ${SOURCE_SUITES[*]} source"
    fi

    # 3. Build from source.
    build_from_source
    run_check "$INSTALL_PATH"

    bin=$(command -v criu 2>/dev/null || true)
    if [[ -z $PREFIX && $bin != "$INSTALL_PATH" ]]; then
        log "WARNING: 'criu' on PATH resolves to '${bin:-nothing}', not $INSTALL_PATH; put /usr/local/sbin first in PATH"
    fi
}

main "$@"
