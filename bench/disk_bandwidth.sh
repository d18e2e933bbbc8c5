#!/usr/bin/env bash
# The swap directory's disk, measured with dd and direct I/O (no page cache), to set beside an
# NVMe-offloaded step in the same call (issue 38's disk-bandwidth bound):
#   bash bench/disk_bandwidth.sh DIR GB    -> one JSON line: GB/s written and read by one stream
#   and by four concurrent streams (as four ranks swap), GB per stream, 16 MiB requests.
set -uo pipefail
dir="${1:?directory}"; gb="${2:?GB per stream}"
count=$((gb * 64))  # 16 MiB blocks
rate() { # op streams: GB/s over all streams
  local op=$1 n=$2 t0 t1
  t0=$(date +%s.%N)
  for i in $(seq 1 "$n"); do
    if [ "$op" = write ]; then
      dd if=/dev/zero of="$dir/dd-$i" bs=16M count="$count" oflag=direct status=none &
    else
      dd if="$dir/dd-$i" of=/dev/null bs=16M iflag=direct status=none &
    fi
  done
  wait
  t1=$(date +%s.%N)
  python3 -c "print(round($n * $count * 16 * 2**20 / 1e9 / ($t1 - $t0), 3))"
}
w1=$(rate write 1); r1=$(rate read 1)
w4=$(rate write 4); r4=$(rate read 4)
rm -f "$dir"/dd-*
echo "{\"dir\": \"$dir\", \"gb_per_stream\": $gb, \"write_gbs_1\": $w1, \"read_gbs_1\": $r1, \"write_gbs_4\": $w4, \"read_gbs_4\": $r4, \"filesystem\": \"$(df -T "$dir" | awk 'NR==2{print $2}')\"}"
