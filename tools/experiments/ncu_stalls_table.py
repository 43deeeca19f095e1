"""Experiment helper: ncu_stalls.sh's CSVs side by side (metric per row, one column a file)."""
import csv
import sys

cols, names = {}, []
for path in sys.argv[1:]:
    rows = [line for line in open(path) if line.startswith('"')]
    vals = {}
    for r in csv.DictReader(rows):
        n = r["Metric Name"].replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
        vals[n] = r["Metric Value"].replace(",", "")
        if n not in names:
            names.append(n)
    cols[path.rsplit("/", 1)[-1].removesuffix(".csv")] = vals
print("metric | " + " | ".join(cols))
for n in names:
    v = [cols[c].get(n, "") for c in cols]
    try:
        if all(float(x) < 0.02 for x in v):
            continue
    except ValueError:
        pass
    print(n + " | " + " | ".join(v))
