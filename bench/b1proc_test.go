package main

import "testing"

// TestProbeMerge: a child's counts are added to the run, and a name whose
// first token of a run is not above its last token of an earlier run is a
// token regression.
func TestProbeMerge(t *testing.T) {
	p := newLockProbe("B1", keyB1Procs, 4, 4, true, false)
	r := p.start()
	r.merge(0, 10, 0, 0, []int64{1, 2}, []int64{5, 6})
	r.merge(2, 7, 1, 2, []int64{3, 0}, []int64{4, 0}) // the second name of this child had no grant
	p.finish(true, true)
	if p.safety.Grants != 17 || p.safety.Violations != 1 || p.safety.Regressions != 2 {
		t.Fatalf("after run 1: %+v", p.safety)
	}
	r = p.start()
	// Name 0 goes on above 5; name 1 starts at 6 again (a regression);
	// name 3 gets its first grant.
	r.merge(0, 4, 0, 0, []int64{7, 6}, []int64{8, 9})
	r.merge(2, 4, 0, 0, []int64{5, 1}, []int64{5, 1})
	p.finish(true, true)
	if p.safety.Runs != 2 || p.safety.Grants != 25 || p.safety.Violations != 1 || p.safety.Regressions != 3 {
		t.Fatalf("after run 2: %+v", p.safety)
	}
}
