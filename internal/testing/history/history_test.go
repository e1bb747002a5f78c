package history

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const ms = int64(time.Millisecond)

// op builds an operation called at call ms and returned at ret ms (ret < 0:
// unknown) on the recorder's clock.
func op(client int, call, ret int64, in Input, out Output) Op {
	r, rw := ret*ms, ret*1000
	if ret < 0 {
		r, rw = math.MaxInt64, math.MaxInt64
	}
	// The wall clock in µs is the database clock of the cases: 0 at 0 ms.
	return Op{Client: client, Input: in, Output: out, Call: call * ms, Return: r, CallWall: call * 1000, ReturnWall: rw}
}

// grant is an acquire of lock "L" by holder returning token with its expiry
// at db µs + ttl; the local deadline is call + ttl.
func grant(client int, call, ret int64, holder string, token, db int64, ttl time.Duration) Op {
	return op(client, call, ret, Input{Kind: Acquire, Key: "L", Holder: holder, TTL: ttl},
		Output{Outcome: OK, Token: token, Expires: db + ttl.Microseconds(), Deadline: call*ms + int64(ttl)})
}

func release(client int, call, ret int64, holder string, token int64, out Outcome) Op {
	return op(client, call, ret, Input{Kind: Release, Key: "L", Holder: holder, Token: token}, Output{Outcome: out})
}

func write(client int, call, ret int64, token int64, mode, value string, out Outcome) Op {
	return op(client, call, ret, Input{Kind: Write, Key: "row", Lock: "L", Token: token, Mode: mode, Value: value}, Output{Outcome: out})
}

func checks(vs []Violation) string {
	var s []string
	for _, v := range vs {
		s = append(s, v.Check)
	}
	return strings.Join(s, ",")
}

const sec = int64(time.Second / time.Microsecond) // µs

func TestCheckHistories(t *testing.T) {
	ttl := time.Second
	cases := []struct {
		name string
		ops  []Op
		want string // the violated checks, "" = legal
	}{
		{"sequential grants with releases", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 2, 4000, ttl), write(1, 6, 7, 2, "strict", "b", OK), release(1, 8, 9, "b", 2, OK),
		}, ""},
		{"a grant after the expiry, without release", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			grant(1, 1100, 1101, "b", 2, 1100*1000, ttl),
			write(1, 1102, 1103, 2, "strict", "b", OK),
			write(0, 1104, 1105, 1, "strict", "a", Stale),
		}, ""},
		{"a grant over a live lease", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			grant(1, 500, 501, "b", 2, 500*1000, ttl),
		}, "lease,expiry,deadline"},
		{"a release called again after one with an unknown outcome", []Op{
			// The inspection shows that the first release happened.
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, Unknown),
			op(1, 4, 5, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 1}),
			op(0, 6, 7, Input{Kind: Release, Key: "L", Holder: "a", Token: 1, Retry: true}, Output{Outcome: OK}),
			grant(1, 8, 9, "b", 2, 8000, ttl),
		}, ""},
		{"a released lease released again without an unknown attempt before", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK), release(0, 4, 5, "a", 1, OK),
		}, "lease"},
		{"a release answered done once another holder took the name", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 2, 4000, ttl), release(0, 6, 7, "a", 1, OK),
		}, "lease"},
		{"a token issued twice", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 1, 4000, ttl),
		}, "lease"},
		{"tokens skipped beyond what unseen grants explain", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 3+maxGhosts, 4000, ttl),
		}, "lease"},
		{"a skipped token explained by a cut grant", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			op(1, 3, -1, Input{Kind: Acquire, Key: "L", Holder: "c", TTL: ttl}, Output{Outcome: Unknown}),
			grant(2, 1100, 1101, "b", 3, 1100*1000, ttl),
		}, ""},
		{"a skipped token: a handoff expired before the waiter read it", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			grant(1, 2, 1500, "w", 3, 1400*1000, ttl), // waited from 2 ms; handed token 2 at 5 ms, paused past its expiry
			release(0, 4, 5, "a", 1, OK),
		}, ""},
		{"a waiter handed the lease twice, another client's grant between", []Op{
			// w queued at 1 ms and was paused: the release at 2 ms handed
			// it 2, which expired unread; b took 3 and its release handed
			// w 4, which expired unread too; c took 5 and its release
			// handed w 6, which w returned.
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 1, 2300, "w", 6, 2152*1000, ttl),
			op(5, 500, 501, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 2, Holder: "w", Expires: 2000 + sec, DBNow: 500 * 1000}),
			grant(2, 1100, 1101, "b", 3, 1100*1000, ttl), release(2, 1102, 1103, "b", 3, OK),
			op(5, 1200, 1201, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 4, Holder: "w", Expires: 1102*1000 + sec, DBNow: 1200 * 1000}),
			grant(3, 2150, 2151, "c", 5, 2150*1000, ttl), release(3, 2152, 2153, "c", 5, OK),
		}, ""},
		{"a grant before a lease handed to a waiter could expire", []Op{
			// The release at 2 ms handed w token 2 (an inspect saw it),
			// which expires no earlier than 2 ms + w's TTL: b's grant at
			// 200 ms comes before, and w gave back at most one handoff.
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 1, 900, "w", 7, 850*1000, ttl),
			op(5, 100, 101, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 2, Holder: "w", Expires: 2000 + sec, DBNow: 100 * 1000}),
			grant(2, 200, 201, "b", 3, 200*1000, ttl), release(2, 202, 203, "b", 3, OK),
			op(5, 300, 301, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 4, Holder: "w", Expires: 202*1000 + sec, DBNow: 300 * 1000}),
			grant(3, 400, 401, "c", 5, 400*1000, ttl), release(3, 402, 403, "c", 5, OK),
			op(5, 500, 501, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 6, Holder: "w", Expires: 402*1000 + sec, DBNow: 500 * 1000}),
		}, "lease"},
		{"a grant after an unseen grant given back before its expiry", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			op(1, 4, -1, Input{Kind: Acquire, Key: "L", Holder: "b", TTL: ttl}, Output{Outcome: Unknown}), // granted 2 too late, gave it back
			op(2, 6, 7, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 2, Holder: "b", Expires: 5000 + sec, DBNow: 6000}),
			grant(3, 10, 11, "c", 3, 10*1000, ttl),
		}, ""},
		{"a failover that lost grants, then an epoch bump", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(0, 4, 5, "a", 2, 4000, ttl), release(0, 6, 7, "a", 2, OK),
			op(9, 8, 9, Input{Kind: Bump, Key: "L", Token: 1}, Output{Outcome: OK}), // the new primary had token 1
			grant(1, 10, 11, "b", 2+EpochSize, 10*1000, ttl),
		}, ""},
		{"a failover that lost grants, without a bump", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(0, 4, 5, "a", 2, 4000, ttl), release(0, 6, 7, "a", 2, OK),
			grant(1, 10, 11, "b", 2, 10*1000, ttl), // token 2 again
		}, "lease"},
		{"a cut grant seen only by a busy answer", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			op(0, 4, -1, Input{Kind: Acquire, Key: "L", Holder: "a", TTL: ttl}, Output{Outcome: Unknown}),
			op(1, 10, 11, Input{Kind: Acquire, Key: "L", Holder: "b", TTL: ttl}, Output{Outcome: Busy, Holder: "a", Expires: 5000 + sec}),
		}, ""},
		{"a release by the previous holder accepted", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			grant(1, 1100, 1101, "b", 2, 1100*1000, ttl),
			release(0, 1102, 1103, "a", 1, OK),
		}, "lease"},
		{"a cut release may have applied", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			release(0, 2, -1, "a", 1, Unknown),
			grant(1, 10, 11, "b", 2, 10*1000, ttl),
		}, ""},
		{"a renewal extends the expiry", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			op(0, 500, 501, Input{Kind: Renew, Key: "L", Holder: "a", Token: 1, TTL: ttl}, Output{Outcome: OK, Expires: 500*1000 + sec, Deadline: 1500 * ms}),
			grant(1, 1200, 1201, "b", 2, 1200*1000, ttl),
		}, "lease,expiry,deadline"},
		{"a busy answer after the expiry", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			op(1, 1200, 1201, Input{Kind: Acquire, Key: "L", Holder: "b", TTL: ttl}, Output{Outcome: Busy, Holder: "a", DBNow: 1200 * 1000}),
		}, "lease"},
		{"an inspect that misses a grant", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			op(1, 2, 3, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK}),
		}, "lease"},
		{"strict write twice with one token", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			write(0, 2, 3, 1, "strict", "x", OK), write(0, 4, 5, 1, "strict", "y", OK),
		}, "row"},
		{"strict replay answered already applied, re-entrant accepted", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			write(0, 2, 3, 1, "strict", "x", OK), write(0, 4, 5, 1, "strict", "x", Applied), write(0, 6, 7, 1, "reentrant", "y", OK),
			op(0, 8, 9, Input{Kind: Read, Key: "row", Lock: "L", Token: 1}, Output{Outcome: OK, Value: "y"}),
		}, ""},
		{"a read that misses the last write", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl),
			write(0, 2, 3, 1, "strict", "x", OK),
			op(0, 8, 9, Input{Kind: Read, Key: "row", Lock: "L", Token: 1}, Output{Outcome: OK, Value: ""}),
		}, "row"},
		{"a write under a token nobody was granted", []Op{
			write(0, 2, 3, 5, "strict", "x", OK),
		}, "granted"},
		{"a stale write accepted", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 2, 4000, ttl), write(1, 6, 7, 2, "strict", "b", OK),
			write(0, 8, 9, 1, "strict", "a", OK),
		}, "row"},
		{"a completion under a stale claim", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(1, 1100, 1101, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 11, Expires: 1100*1000 + sec}),
			op(0, 1102, 1103, Input{Kind: Complete, Key: "j", Token: 10}, Output{Outcome: OK}),
		}, "job"},
		{"a claim over a live claim", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(1, 100, 101, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 11, Expires: 100*1000 + sec}),
		}, "job"},
		{"completion and a lost answer for the stale one", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(1, 1100, 1101, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 11, Expires: 1100*1000 + sec}),
			op(0, 1102, 1103, Input{Kind: Complete, Key: "j", Token: 10}, Output{Outcome: Lost}),
			op(1, 1104, 1105, Input{Kind: Complete, Key: "j", Token: 11}, Output{Outcome: OK}),
		}, ""},
		{"an unseen grant seen held, then given back inside its call", []Op{
			op(0, 0, 100, Input{Kind: Acquire, Key: "L", Holder: "a", TTL: ttl}, Output{Outcome: Unknown}),
			op(1, 10, 11, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 1, Holder: "a", Expires: 10*1000 + sec, DBNow: 10 * 1000}),
			op(1, 20, 21, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 1, DBNow: 20 * 1000}),
		}, ""},
		{"a returned grant freed without a release", []Op{
			grant(0, 0, 5, "a", 1, 0, ttl),
			op(1, 10, 11, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 1, Holder: "a", Expires: sec, DBNow: 10 * 1000}),
			op(1, 20, 21, Input{Kind: Inspect, Key: "L"}, Output{Outcome: OK, Token: 1, DBNow: 20 * 1000}),
		}, "lease"},
		{"a completed job claimed again in the same epoch", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(0, 2, 3, Input{Kind: Complete, Key: "j", Token: 10}, Output{Outcome: OK}),
			op(1, 2000, 2001, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 11, Expires: 2000*1000 + sec}),
		}, "job"},
		{"a completed job claimed again after an epoch bump (the failover lost the completion)", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(0, 2, 3, Input{Kind: Complete, Key: "j", Token: 10}, Output{Outcome: OK}),
			op(1, 2000, 2001, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: EpochSize + 11, Expires: 2000*1000 + sec}),
			op(1, 2002, 2003, Input{Kind: Complete, Key: "j", Token: EpochSize + 11}, Output{Outcome: OK}),
		}, ""},
		{"a completed job claimed twice in the new epoch", []Op{
			op(0, 0, 1, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: 10, Expires: sec}),
			op(0, 2, 3, Input{Kind: Complete, Key: "j", Token: 10}, Output{Outcome: OK}),
			op(1, 2000, 2001, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: EpochSize + 11, Expires: 2000*1000 + sec}),
			op(1, 2002, 2003, Input{Kind: Complete, Key: "j", Token: EpochSize + 11}, Output{Outcome: OK}),
			op(2, 4000, 4001, Input{Kind: Claim, Key: "j", TTL: ttl}, Output{Outcome: OK, Token: EpochSize + 12, Expires: 4000*1000 + sec}),
		}, "job"},
		{"an enqueue under a superseded token accepted", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 2, 4000, ttl),
			op(0, 6, 7, Input{Kind: Enqueue, Key: "L", Token: 1}, Output{Outcome: OK}),
		}, "lease"},
		{"an enqueue of a released lease refused as not held", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			op(0, 4, 5, Input{Kind: Enqueue, Key: "L", Token: 1}, Output{Outcome: Lost}),
		}, ""},
		{"an enqueue under a superseded token refused as not held (the token is checked first)", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 2, 3, "a", 1, OK),
			grant(1, 4, 5, "b", 2, 4000, ttl),
			op(0, 6, 7, Input{Kind: Enqueue, Key: "L", Token: 1}, Output{Outcome: Lost}),
		}, "lease"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			vs, sum := Check(c.ops)
			if got := checks(vs); got != c.want {
				t.Fatalf("violations %q, want %q: %v", got, c.want, vs)
			}
			if sum.Ops != len(c.ops) {
				t.Errorf("summary counts %d operations, want %d", sum.Ops, len(c.ops))
			}
			for _, v := range vs {
				if v.Op.Input.Kind == "" || v.Msg == "" {
					t.Errorf("violation %v names no operation", v)
				}
			}
		})
	}
}

// TestCheckNamesTheBreakingOperation: the model violation names the operation
// no order can place and the state before it, and Save writes the history
// and porcupine's visualization.
func TestCheckNamesTheBreakingOperation(t *testing.T) {
	ops := []Op{
		grant(0, 0, 1, "a", 1, 0, time.Second), release(0, 2, 3, "a", 1, OK),
		grant(1, 4, 5, "b", 2, 4000, time.Second),
		release(0, 6, 7, "a", 1, OK), // the broken one: a's lease ended at 3
		grant(2, 8, 9, "c", 3, 8000, time.Second),
	}
	vs, _ := Check(ops)
	if len(vs) == 0 || vs[0].Check != "lease" {
		t.Fatalf("violations %v, want a lease violation first", vs)
	}
	if v := vs[0]; v.Op.Input.Kind != Release || v.Op.Call != 6*ms || !strings.Contains(v.State, "token 2 held by b") {
		t.Errorf("violation names %v in state %q, want the second release in state token 2 held by b", v.Op, v.State)
	}
	dir, err := Save(ops, vs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, f := range []string{"history.json", "violations.txt", "history-0-lease.html"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil || len(b) == 0 {
			t.Errorf("%s: %d bytes, %v", f, len(b), err)
		}
	}
}

// TestRecorderOpenReturn: an unknown outcome has an open return and moves the
// client to a new id.
func TestRecorderOpenReturn(t *testing.T) {
	r := New()
	c := r.NewClient()
	id := c.ID()
	p := c.begin(Input{Kind: Acquire, Key: "L", Holder: "a", TTL: time.Second})
	c.end(p, Output{Outcome: Unknown})
	p = c.begin(Input{Kind: Acquire, Key: "L", Holder: "a", TTL: time.Second})
	c.end(p, Output{Outcome: Busy})
	ops := r.Ops()
	if len(ops) != 2 || ops[0].Return != math.MaxInt64 || ops[1].Return == math.MaxInt64 || ops[0].Client != id || ops[1].Client == id {
		t.Fatalf("ops %v: want the unknown one open under client %d, the next under a new id", ops, id)
	}
}

// TestJournal: a worker's journal carries its operations on the parent's
// clock, and a call without a return (a killed worker) becomes an unknown
// outcome.
func TestJournal(t *testing.T) {
	parent := New()
	path := filepath.Join(t.TempDir(), "w.jsonl")
	env := parent.JournalEnv(path, 1000)
	k, v, _ := strings.Cut(env, "=")
	t.Setenv(k, v)
	before := parent.Now()
	child, err := FromEnv()
	if err != nil || child == nil {
		t.Fatalf("FromEnv: %v, %v", child, err)
	}
	c := child.NewClient()
	p := c.begin(Input{Kind: Acquire, Key: "L", Holder: "w", TTL: time.Second})
	c.end(p, Output{Outcome: OK, Token: 1, Expires: 5})
	c.begin(Input{Kind: Release, Key: "L", Holder: "w", Token: 1}) // killed before it returned
	after := parent.Now()
	if err := parent.ReadJournal(path); err != nil {
		t.Fatal(err)
	}
	ops := parent.Ops()
	if len(ops) != 2 {
		t.Fatalf("ops %v, want 2", ops)
	}
	if ops[0].Client < 1000 || ops[0].Output.Token != 1 || ops[0].Call < before || ops[0].Return > after {
		t.Errorf("returned op %v: want client ≥ 1000, token 1, within [%d, %d] on the parent's clock", ops[0], before, after)
	}
	if ops[1].Input.Kind != Release || ops[1].Output.Outcome != Unknown || ops[1].Return != math.MaxInt64 {
		t.Errorf("cut op %v: want the release, unknown, open", ops[1])
	}
}

// A release that returned just before a crash may be undone by it, unless a
// grant or renewal called after it returned ok before the crash (its
// synchronous commit flushed the release's commit record first).
func TestLostInCrashFlushedByLaterGrant(t *testing.T) {
	ttl := time.Second
	cases := []struct {
		name  string
		ops   []Op
		lossy bool
	}{
		{"no later commit", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 101, "a", 1, OK),
		}, true},
		{"a later grant acknowledged before the crash", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 101, "a", 1, OK),
			grant(1, 102, 103, "b", 2, 102000, ttl),
		}, false},
		{"a later renewal acknowledged before the crash", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 101, "a", 1, OK),
			op(1, 150, 160, Input{Kind: Renew, Key: "M", Holder: "c", Token: 7, TTL: ttl}, Output{Outcome: OK}),
		}, false},
		{"the grant started before the release returned", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 110, "a", 1, OK),
			grant(1, 105, 120, "b", 2, 105000, ttl),
		}, true},
		{"the grant returned after the crash", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 101, "a", 1, OK),
			grant(1, 102, 300, "b", 2, 102000, ttl),
		}, true},
		{"a later busy answer flushes nothing", []Op{
			grant(0, 0, 1, "a", 1, 0, ttl), release(0, 100, 101, "a", 1, OK),
			op(1, 102, 103, Input{Kind: Acquire, Key: "L", Holder: "b", TTL: ttl}, Output{Outcome: Busy}),
		}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			r.Add(tc.ops...)
			r.crashes = append(r.crashes, 200*ms)
			var got *Op
			for _, o := range r.Ops() {
				if o.Input.Kind == Release {
					got = &o
				}
			}
			if got == nil || got.Input.Lossy != tc.lossy {
				t.Fatalf("release lossy = %v, want %v", got != nil && got.Input.Lossy, tc.lossy)
			}
		})
	}
}

// An unseen grant never takes a token that a returned grant has: that
// grant would then have no legal place (tokens only rise), so the search
// does not fork on it.
func TestGhostsSkipReturnedTokens(t *testing.T) {
	s := leaseState{Token: 4}
	free := ghosts(s, "c", 1000, 10, &tokenSet{m: map[int64]bool{7: true}})
	// Tokens 5 and 6 may be unseen grants (each held or given back); 7 is
	// a returned grant's, so the chain stops before it.
	if len(free) != 5 {
		t.Fatalf("ghosts from token 4 with 7 returned: %d states, want 5: %v", len(free), free)
	}
	for _, st := range free {
		if tok := st.(leaseState).Token; tok > 6 {
			t.Errorf("an unseen grant took token %d, which a returned grant has", tok)
		}
	}
	if got := ghosts(s, "c", 1000, 10, &tokenSet{m: map[int64]bool{5: true}}); len(got) != 1 {
		t.Errorf("ghosts with the next token returned: %d states, want only the unchanged one", len(got))
	}
	if got := ghosts(s, "c", 1000, 10, nil); len(got) != 1+2*maxGhosts {
		t.Errorf("ghosts with no returned tokens: %d states, want %d", len(got), 1+2*maxGhosts)
	}
}

// A release may hand the lease only to a wait whose acquire call overlaps
// it (a cut call's for as long as its return is open or bounded), and the
// handed lease cannot expire before the release's call + that wait's TTL.
func TestHandTargets(t *testing.T) {
	ttl, short := time.Second, 200*time.Millisecond
	ops := []Op{
		grant(0, 0, 1, "a", 1, 0, ttl),
		release(0, 100, 101, "a", 1, OK),
		op(1, 50, 150, Input{Kind: Acquire, Key: "L", Holder: "w", TTL: short}, Output{Outcome: OK, Token: 2, Expires: 101*1000 + short.Microseconds()}),
		op(2, 90, -1, Input{Kind: Acquire, Key: "L", Holder: "cut", TTL: ttl}, Output{Outcome: Unknown}),
		op(3, 102, 103, Input{Kind: Acquire, Key: "L", Holder: "later", TTL: ttl}, Output{Outcome: Busy, Holder: "w"}),
		op(4, 2, 3, Input{Kind: Acquire, Key: "L", Holder: "earlier", TTL: ttl}, Output{Outcome: Busy, Holder: "a"}),
	}
	handTargets(ops)
	got := ops[1].Input.handTo
	want := []handTarget{
		{Holder: "w", Floor: 100*1000 + short.Microseconds()},
		{Holder: "cut", Floor: 100*1000 + ttl.Microseconds()},
	}
	if len(got) != len(want) {
		t.Fatalf("targets of the release: %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("target %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	for i, o := range ops {
		if o.Input.Kind != Release && o.Input.handTo != nil {
			t.Errorf("op %d (%s) has hand targets", i, o.Input.Kind)
		}
	}
}
