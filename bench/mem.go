package main

import (
	"os"
	"strconv"
	"strings"
)

// memRow records the allocations per operation of a single-client series;
// the rows are appended after the throughput rows.
func (b *bench) memRow(what string, s series) {
	if len(s.allocs) == 0 {
		return
	}
	b.memRows = append(b.memRows,
		newRow("M memory", what, 1, "allocs/op", s.allocs),
		newRow("M memory", what, 1, "bytes/op", s.bytes))
}

// rssRows reports the peak and current resident set size of this process.
func rssRows() []Row {
	hwm, rss, err := readRSS()
	if err != nil {
		return []Row{notMeasured("M memory", "bench process RSS", 0, "MiB", err.Error())}
	}
	return []Row{
		newRow("M memory", "bench process peak RSS (VmHWM)", 0, "MiB", []float64{hwm}),
		newRow("M memory", "bench process RSS at end (VmRSS)", 0, "MiB", []float64{rss}),
	}
}

func readRSS() (hwm, rss float64, err error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		kb, perr := strconv.ParseFloat(f[0], 64)
		if perr != nil {
			continue
		}
		switch k {
		case "VmHWM":
			hwm = kb / 1024
		case "VmRSS":
			rss = kb / 1024
		}
	}
	return hwm, rss, nil
}
