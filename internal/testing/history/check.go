package history

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// Violation is one way a history is illegal.
type Violation struct {
	Check string // "lease", "row", "job" (a model) or a real-time check's name
	Key   string // the lock name, row or job
	Op    Op     // the operation that broke it: the first one no legal order can place, or the later of two
	Other *Op    // the earlier operation it conflicts with (real-time checks)
	State string // model: the state the longest legal order ends in
	Msg   string

	model   porcupine.Model
	info    porcupine.LinearizationInfo
	hasInfo bool
}

func (v Violation) String() string {
	s := fmt.Sprintf("%s %q: %s: %v", v.Check, v.Key, v.Msg, v.Op)
	if v.Other != nil {
		s += fmt.Sprintf("; earlier: %v", *v.Other)
	}
	if v.State != "" {
		s += "; state before it: " + v.State
	}
	return s
}

// Summary counts what a check looked at.
type Summary struct {
	Ops      int            // operations checked
	PerModel map[string]int // operations per model
	Keys     map[string]int // partitions (lock names, rows, jobs) per model
	Unknown  int            // operations with an unknown outcome
	Outcomes map[string]int // operations per "kind/outcome"
	Took     time.Duration  // check time
}

func (s Summary) String() string {
	var parts []string
	for _, m := range []string{"lease", "row", "job"} {
		if s.PerModel[m] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d ops/%d keys", m, s.PerModel[m], s.Keys[m]))
		}
	}
	return fmt.Sprintf("%d operations (%s), %d unknown, checked in %v", s.Ops, strings.Join(parts, ", "), s.Unknown, s.Took.Round(time.Millisecond))
}

// checkTimeout bounds the search of one partition. A search that runs out
// is reported as a violation (inconclusive is not a pass).
var checkTimeout = 2 * time.Minute

func init() {
	if v, err := time.ParseDuration(os.Getenv("PGFENCE_HISTORY_TIMEOUT")); err == nil {
		checkTimeout = v
	}
}

// Check checks ops against the three models and the real-time checks, and
// returns every violation found (nil when the history is legal).
func Check(ops []Op) ([]Violation, Summary) {
	start := time.Now()
	sum := Summary{Ops: len(ops), PerModel: map[string]int{}, Keys: map[string]int{}, Outcomes: map[string]int{}}
	for _, o := range ops {
		sum.Outcomes[string(o.Input.Kind)+"/"+string(o.Output.Outcome)]++
		if o.Output.Outcome == Unknown {
			sum.Unknown++
		}
	}
	var out []Violation
	for _, name := range []string{"lease", "row", "job"} {
		m := models[name]
		byKey := map[string][]Op{}
		var keys []string
		for _, o := range ops {
			if !m.kinds[o.Input.Kind] {
				continue
			}
			if _, ok := byKey[o.Input.Key]; !ok {
				keys = append(keys, o.Input.Key)
			}
			if o.Input.Kind == Acquire {
				o.Input.ReturnWall = o.ReturnWall
			}
			byKey[o.Input.Key] = append(byKey[o.Input.Key], o)
			sum.PerModel[name]++
			if o.Input.Kind == Acquire && o.Output.Outcome != Unknown {
				// A companion: the grants this call may have had without
				// returning them (model.go, ghost). A cut call forks so
				// itself.
				g := o
				g.Input.Kind, g.Output = ghost, Output{}
				byKey[o.Input.Key] = append(byKey[o.Input.Key], g)
			}
			if o.Input.Kind == Acquire {
				// And the give-back of such a grant, later in the call
				// (model.go, giveBack).
				g := o
				g.Input.Kind, g.Output = giveBack, Output{}
				byKey[o.Input.Key] = append(byKey[o.Input.Key], g)
			}
		}
		sum.Keys[name] = len(keys)
		if name == "lease" {
			for _, k := range keys {
				b := unseenBudget(byKey[k])
				g := &tokenSet{m: map[int64]bool{}}
				for _, o := range byKey[k] {
					if o.Input.Kind == Acquire && o.Output.Outcome == OK {
						g.m[o.Output.Token] = true
					}
				}
				for i := range byKey[k] {
					byKey[k][i].Input.Budget = b
					byKey[k][i].Input.granted = g
				}
				handTargets(byKey[k])
			}
		}
		nm := m.model
		model := setModel(nm)
		for _, k := range keys {
			part := byKey[k]
			hist := toPorcupine(part)
			// The plain search first: the verbose one also keeps the
			// longest partial linearization of every operation at each
			// backtrack, which only a failing history needs.
			if porcupine.CheckOperationsTimeout(model, hist, checkTimeout) == porcupine.Ok {
				continue
			}
			res, info := porcupine.CheckOperationsVerbose(model, hist, checkTimeout)
			switch res {
			case porcupine.Ok:
				continue
			case porcupine.Unknown:
				out = append(out, Violation{Check: name, Key: k, Msg: fmt.Sprintf("the search ran out of its %v: no verdict", checkTimeout),
					Op: part[len(part)-1], model: model, info: info, hasInfo: true})
				continue
			}
			v := Violation{Check: name, Key: k, Msg: "no order of the operations consistent with real time explains every output",
				model: model, info: info, hasInfo: true}
			v.Op, v.State = blocker(nm, part, info)
			out = append(out, v)
		}
	}
	out = append(out, realTime(ops)...)
	sum.Took = time.Since(start)
	return out, sum
}

// handTargets sets the waits each release of ops (one lock's) may have
// handed the lease to: a release hands it to the first live queue row of the
// lock, in the same statement, and the waiter may never read it (paused past
// its expiry, cut). A queue row lives while its acquire call does (and, for
// a cut call, until its bounded return: see BoundCutAcquires); once the call
// returned a lease, its row is served. So the targets are the holders and
// TTLs of the acquires whose call overlaps the release's.
func handTargets(ops []Op) {
	var acq []Op
	for _, o := range ops {
		if o.Input.Kind == Acquire {
			acq = append(acq, o)
		}
	}
	slices.SortFunc(acq, func(a, b Op) int { return cmp.Compare(a.Call, b.Call) })
	for i := range ops {
		r := &ops[i]
		if r.Input.Kind != Release {
			continue
		}
		seen := map[handTarget]bool{}
		for _, a := range acq {
			if a.Call > r.Return {
				break
			}
			if a.Return < r.Call {
				continue
			}
			t := handTarget{Holder: a.Input.Holder, Floor: r.CallWall + a.Input.TTL.Microseconds()}
			if !seen[t] {
				seen[t] = true
				r.Input.handTo = append(r.Input.handTo, t)
			}
		}
	}
}

// unseenBudget counts the tokens of one lock, up to the highest any output
// named, that no returned grant has: the unseen grants the history can
// need.
func unseenBudget(ops []Op) int64 {
	granted := map[int64]bool{}
	var top int64
	var bumps []int64 // tokens an epoch bump started from: (b, b+EpochSize] are never granted
	for _, o := range ops {
		top = max(top, o.Output.Token, o.Input.Token)
		if o.Input.Kind == Acquire && o.Output.Outcome == OK {
			granted[o.Output.Token] = true
		}
		if o.Input.Kind == Bump {
			bumps = append(bumps, o.Input.Token)
		}
	}
	jumped := func(t int64) bool {
		for _, b := range bumps {
			if t > b && t <= b+EpochSize {
				return true
			}
		}
		return false
	}
	n := top
	for _, b := range bumps {
		if b < top {
			n -= min(b+EpochSize, top) - b
		}
	}
	for t := range granted {
		if t >= 1 && t <= top && !jumped(t) {
			n--
		}
	}
	// A busy answer names a holder and an expiry but no token: one that no
	// returned grant or renewal had witnesses an unseen grant, perhaps
	// above every token named.
	known := map[int64]bool{}
	for _, o := range ops {
		if (o.Input.Kind == Acquire || o.Input.Kind == Renew) && o.Output.Outcome == OK {
			known[o.Output.Expires] = true
		}
	}
	witnessed := map[[2]any]bool{}
	for _, o := range ops {
		if o.Input.Kind == Acquire && o.Output.Outcome == Busy && o.Output.Holder != "" && o.Output.Expires != 0 && !known[o.Output.Expires] {
			witnessed[[2]any{o.Output.Holder, o.Output.Expires}] = true
		}
	}
	return max(n, 0) + int64(len(witnessed))
}

// blocker finds, for an illegal partition, the operation no legal order can
// place: of the operations missing from the longest partial linearization,
// the one that returned first. It also replays that linearization to give
// the state it ends in.
func blocker(nm porcupine.NondeterministicModel, part []Op, info porcupine.LinearizationInfo) (Op, string) {
	var longest []int
	for _, lin := range info.PartialLinearizations() {
		for _, l := range lin {
			if len(l) > len(longest) {
				longest = l
			}
		}
	}
	in := make(map[int]bool, len(longest))
	for _, id := range longest {
		in[id] = true
	}
	best := -1
	for i, o := range part {
		if !in[i] && (best < 0 || o.Return < part[best].Return) {
			best = i
		}
	}
	if best < 0 {
		best = len(part) - 1
	}
	states := nm.Init()
	for _, id := range longest {
		var next []any
		for _, s := range states {
			next = append(next, nm.Step(s, part[id].Input, part[id].Output)...)
		}
		states = next
	}
	var desc []string
	for _, s := range states {
		d := nm.DescribeState(s)
		if !slices.Contains(desc, d) {
			desc = append(desc, d)
		}
	}
	return part[best], strings.Join(desc, " | ")
}

// realTime runs the checks a sequential model cannot express, over lease
// grants (by lock name and token):
//
//   - expiry: a grant of token t+1 whose lease t was not released has a
//     database time at or after every expiry lease t was known to have (its
//     grant, each renewal that returned, each busy answer and read naming it);
//   - deadline: such a grant returned no earlier than lease t's local
//     deadline (the send time of its grant or latest returned renewal plus
//     the TTL): its holder stopped believing it held the lease before anyone
//     else could have been granted it;
//   - granted: every token a write, read or enqueue had accepted came from a
//     grant of that lock to that token whose call started before the write
//     returned.
func realTime(ops []Op) []Violation {
	type lease struct {
		grant    *Op
		expires  int64 // µs, database clock
		expOp    *Op
		deadline int64 // recorder ns
		dlOp     *Op
		released *Op // a release that returned ok or may have applied
	}
	leases := map[string]map[int64]*lease{}
	get := func(name string, token int64) *lease {
		m := leases[name]
		if m == nil {
			m = map[int64]*lease{}
			leases[name] = m
		}
		l := m[token]
		if l == nil {
			l = &lease{}
			m[token] = l
		}
		return l
	}
	for i := range ops {
		o := &ops[i]
		in, out := o.Input, o.Output
		switch {
		case in.Kind == Acquire && out.Outcome == OK:
			l := get(in.Key, out.Token)
			l.grant = o
			if out.Expires > l.expires {
				l.expires, l.expOp = out.Expires, o
			}
			if out.Deadline > l.deadline {
				l.deadline, l.dlOp = out.Deadline, o
			}
		case in.Kind == Renew && out.Outcome == OK:
			l := get(in.Key, in.Token)
			if out.Expires > l.expires {
				l.expires, l.expOp = out.Expires, o
			}
			if out.Deadline > l.deadline {
				l.deadline, l.dlOp = out.Deadline, o
			}
		case (in.Kind == Inspect || in.Kind == Acquire && out.Outcome == Busy) && out.Token != 0 && out.Holder != "" && out.Expires != 0:
			l := get(in.Key, out.Token)
			if out.Expires > l.expires {
				l.expires, l.expOp = out.Expires, o
			}
		case in.Kind == Release && (out.Outcome == OK || out.Outcome == Unknown):
			l := get(in.Key, in.Token)
			if l.released == nil || o.Call < l.released.Call {
				l.released = o
			}
		}
	}
	var out []Violation
	names := make([]string, 0, len(leases))
	for n := range leases {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, name := range names {
		m := leases[name]
		for token, next := range m {
			if next.grant == nil || token <= 1 {
				continue
			}
			prev := m[token-1]
			if prev == nil || prev.grant == nil {
				// Lease t was never returned to a client (an unseen grant,
				// perhaps given back inside its call): its end is unknown.
				continue
			}
			g := *next.grant
			if prev.released != nil && prev.released.Call < g.Return {
				continue // a release (maybe the one that handed it over) came first
			}
			at := grantTime(g.Output, g.Input.TTL.Microseconds())
			if prev.expOp != nil && at < prev.expires {
				other := *prev.expOp
				out = append(out, Violation{Check: "expiry", Key: name, Op: g, Other: &other,
					Msg: fmt.Sprintf("token %d granted at %d on the database clock, %d µs before lease %d's expiry %d (not released)",
						token, at, prev.expires-at, token-1, prev.expires)})
			}
			if prev.dlOp != nil && g.Return < prev.deadline {
				other := *prev.dlOp
				out = append(out, Violation{Check: "deadline", Key: name, Op: g, Other: &other,
					Msg: fmt.Sprintf("token %d granted %v before the local deadline of lease %d (not released)",
						token, time.Duration(prev.deadline-g.Return), token-1)})
			}
		}
	}
	for _, o := range ops {
		in := o.Input
		if o.Output.Outcome != OK || in.Token == 0 || (in.Kind != Write && in.Kind != Read && in.Kind != Enqueue) {
			continue
		}
		lock := in.Lock
		if lock == "" {
			lock = in.Key
		}
		l := leases[lock][in.Token]
		if l == nil || l.grant == nil || l.grant.Call >= o.Return {
			out = append(out, Violation{Check: "granted", Key: lock, Op: o,
				Msg: fmt.Sprintf("token %d accepted, but no grant of %q to token %d started before the write returned", in.Token, lock, in.Token)})
		}
	}
	return out
}

// Verify checks the recorder's history and fails t on any violation, after
// writing the history (history.json) and, for a model violation, porcupine's
// visualization (history-<model>-<key>.html) under a new directory that the
// failure names. It logs the summary and returns it. With
// PGFENCE_HISTORY_SAVE set, a legal history is written too.
func (r *Recorder) Verify(t testing.TB) Summary {
	t.Helper()
	ops := r.Ops()
	vs, sum := Check(ops)
	t.Logf("history: %v", sum)
	if len(vs) == 0 {
		if os.Getenv("PGFENCE_HISTORY_SAVE") != "" {
			// Kept on request (to re-check or time a legal history).
			dir, err := Save(ops, nil)
			t.Logf("history: saved in %s (PGFENCE_HISTORY_SAVE) %v", dir, err)
		}
		return sum
	}
	dir, err := Save(ops, vs)
	if err != nil {
		t.Errorf("history: saving the illegal history: %v", err)
	}
	for i, v := range vs {
		if i == 20 {
			t.Errorf("history: … %d more violations", len(vs)-i)
			break
		}
		t.Errorf("history: illegal: %v", v)
	}
	t.Errorf("history: %d violations; the history and its visualization are in %s", len(vs), dir)
	return sum
}

// Save writes ops (history.json) and a visualization of each model
// violation in vs under a new temporary directory, and returns it.
func Save(ops []Op, vs []Violation) (string, error) {
	dir, err := os.MkdirTemp("", "pgfence-history-")
	if err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(ops, "", " ")
	if err != nil {
		return dir, err
	}
	if err := os.WriteFile(filepath.Join(dir, "history.json"), b, 0o644); err != nil {
		return dir, err
	}
	var lines []string
	for i, v := range vs {
		lines = append(lines, v.String())
		if !v.hasInfo {
			continue
		}
		info := v.info
		info.AddAnnotations([]porcupine.Annotation{{Tag: "illegal", Start: v.Op.Call, End: min(v.Op.Return, v.Op.Call+int64(time.Second)),
			Description: "first operation no legal order can place", Details: v.Msg, BackgroundColor: "#ff9191"}})
		f := filepath.Join(dir, fmt.Sprintf("history-%d-%s.html", i, v.Check))
		if err := porcupine.VisualizePath(v.model, info, f); err != nil {
			return dir, err
		}
	}
	return dir, os.WriteFile(filepath.Join(dir, "violations.txt"), []byte(strings.Join(lines, "\n")+"\n"), 0o644)
}
