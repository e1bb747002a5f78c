package history

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// A journal carries a history across processes: a test starts worker
// processes (this test binary again) that record into journal files, and
// the test reads them into its own recorder. Each call is written to the
// file before the operation runs and each return after it, one JSON line
// each, with no buffering: a worker killed or frozen mid-operation leaves a
// call without a return, which the reader records as an unknown outcome
// (open return).
//
// The clock of a journal is its parent recorder's: the parent passes its
// start on the wall clock, and the worker counts on its own monotonic clock
// from the wall-clock offset it finds at start (one machine, one clock).

// EnvJournal is the environment variable that hands a worker its journal:
// "path,origin,clientBase" (origin: the parent's start in Unix nanoseconds).
const EnvJournal = "PGFENCE_HISTORY_JOURNAL"

type journal struct {
	mu  sync.Mutex
	f   *os.File
	seq int64
}

type line struct {
	Seq  int64  `json:"seq"`
	Kind string `json:"k"` // "call", "return", "op" (whole)
	Op   Op     `json:"op"`
}

func (j *journal) write(l line) {
	b, err := json.Marshal(l)
	if err != nil {
		panic(err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, err := j.f.Write(append(b, '\n')); err != nil {
		panic(fmt.Sprintf("history journal: %v", err))
	}
}

func (j *journal) begin(p *Pending) int64 {
	j.mu.Lock()
	j.seq++
	seq := j.seq
	j.mu.Unlock()
	j.write(line{Seq: seq, Kind: "call", Op: Op{Client: p.client, Input: p.in, Call: p.call, CallWall: p.wall}})
	return seq
}

func (j *journal) end(seq int64, op Op) { j.write(line{Seq: seq, Kind: "return", Op: op}) }

func (j *journal) whole(op Op) { j.write(line{Kind: "op", Op: op}) }

// JournalEnv returns the environment entry that hands a worker process the
// journal file path, on r's clock, with client ids from clientBase (give
// each worker its own range).
func (r *Recorder) JournalEnv(path string, clientBase int) string {
	return fmt.Sprintf("%s=%s,%d,%d", EnvJournal, path, r.start.UnixNano()-r.offset, clientBase)
}

// FromEnv returns the recorder of a worker process started with
// JournalEnv, or nil when the variable is not set.
func FromEnv() (*Recorder, error) {
	v := os.Getenv(EnvJournal)
	if v == "" {
		return nil, nil
	}
	parts := strings.Split(v, ",")
	if len(parts) != 3 {
		return nil, fmt.Errorf("history: %s=%q: want path,origin,clientBase", EnvJournal, v)
	}
	origin, err1 := strconv.ParseInt(parts[1], 10, 64)
	base, err2 := strconv.Atoi(parts[2])
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("history: %s=%q: want path,origin,clientBase", EnvJournal, v)
	}
	f, err := os.OpenFile(parts[0], os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	return &Recorder{start: start, offset: start.UnixNano() - origin, clients: base, journal: &journal{f: f}}, nil
}

// ReadJournal adds the operations of a worker's journal file to r: every
// returned operation, and every call without a return as an unknown outcome.
// A missing file adds nothing.
func (r *Recorder) ReadJournal(path string) error {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	calls := map[int64]Op{}
	var order []int64
	var ops []Op
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			// A worker killed mid-write leaves a cut last line: its call
			// (if that is what it was) has no return either way.
			continue
		}
		switch l.Kind {
		case "call":
			calls[l.Seq] = l.Op
			order = append(order, l.Seq)
		case "return":
			delete(calls, l.Seq)
			ops = append(ops, l.Op)
		case "op":
			ops = append(ops, l.Op)
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	for _, seq := range order {
		if o, ok := calls[seq]; ok {
			o.Output = Output{Outcome: Unknown}
			o.Return, o.ReturnWall = math.MaxInt64, math.MaxInt64
			ops = append(ops, o)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, ops...)
	return nil
}
