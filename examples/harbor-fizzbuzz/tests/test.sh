#!/bin/bash
# The verifier: uploaded to /tests only after the agent finishes; writes the reward file.
expected=$(cat /tests/expected.txt)
actual=$(timeout 10 python3 /root/fizzbuzz.py 2>/dev/null)
if [ "$actual" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
  diff <(echo "$expected") <(echo "$actual") | head -20
fi
