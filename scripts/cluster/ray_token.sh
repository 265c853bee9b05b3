# Sourced by scripts/cluster/slurm.sbatch: switches on Ray's token authentication for every Ray process the job
# starts (head, workers, the driver), with a token made for this job. Without it anyone who reaches the head's port
# can run code on every node.
#
# The token is in a file only its owner can read, in a folder only its owner can enter
# (EAGLENEST_RAY_TOKEN_DIR, default ~/.eaglenest/ray-tokens: on a cluster, home is on storage every node mounts);
# Ray's processes find it through RAY_AUTH_TOKEN_PATH, so it is on no command line. The sbatch script removes it
# when the job ends.
token_dir=${EAGLENEST_RAY_TOKEN_DIR:-$HOME/.eaglenest/ray-tokens}
(umask 077 && mkdir -p "$token_dir") || exit 2
if [[ "$(stat -c %a "$token_dir")" != 700 || ! -O "$token_dir" ]]; then
    echo "ray_token.sh: $token_dir (EAGLENEST_RAY_TOKEN_DIR) must be a folder of yours that only you can enter" \
         "(mode 700, it is $(stat -c %a "$token_dir")); fix it with chmod 700, or name another" >&2
    exit 2
fi
export RAY_AUTH_TOKEN_PATH="$token_dir/job-${SLURM_JOB_ID:-$$}.token"
# 0600 from its creation (umask), never an existing file (noclobber): 256 random bits, as Ray's own generator makes
if ! (umask 077 && set -o noclobber && python -c 'import secrets; print(secrets.token_hex(32), end="")' \
      > "$RAY_AUTH_TOKEN_PATH") 2> /dev/null; then
    echo "ray_token.sh: could not make a new token file $RAY_AUTH_TOKEN_PATH (is one there from an earlier job of" \
         "this id? remove it)" >&2
    exit 2
fi
export RAY_AUTH_MODE=token
