package main

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of /proc/stat's counters (USER_HZ), 100 on every
// Linux architecture Go runs on.
const clockTick = 10 * time.Millisecond

// machineBusy returns the CPU time all processors of the machine have spent
// outside idle and I/O wait since boot (user, nice, system, irq, softirq and
// steal from /proc/stat's "cpu" line), or ok = false where that file is not
// readable (not Linux). The bench's own process, the PostgreSQL server and the
// peers all run here, so the difference over a run is what that run cost the
// machine in CPU.
func machineBusy() (busy time.Duration, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, false
	}
	var ticks int64
	for i, v := range f[1:9] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, false
		}
		ticks += n
	}
	return time.Duration(ticks) * clockTick, true
}
