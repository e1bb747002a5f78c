package history

import (
	"hash/maphash"

	"github.com/anishathalye/porcupine"
)

// setModel turns a nondeterministic model into a deterministic one whose
// state is the set of states the operations so far can have led to, as
// porcupine's NondeterministicModel does, but with the set kept as a map
// (no quadratic merge), hashed for porcupine's cache, and pruned: of two
// lease states that differ only in how many unseen grants they used, the one
// that used fewer allows everything the other does, so only it is kept.
func setModel(nm porcupine.NondeterministicModel) porcupine.Model {
	type set = map[any]any // state without its Unseen count → the state that used fewest
	add := func(out set, s any) {
		k := s
		if ls, ok := s.(leaseState); ok {
			ls.Unseen = 0
			k = ls
			if have, ok := out[k]; ok && have.(leaseState).Unseen <= s.(leaseState).Unseen {
				return
			}
		}
		out[k] = s
	}
	seed := maphash.MakeSeed()
	return porcupine.Model{
		Init: func() any {
			out := set{}
			for _, s := range nm.Init() {
				add(out, s)
			}
			return out
		},
		Step: func(state, input, output any) (bool, any) {
			out := set{}
			for _, s := range state.(set) {
				for _, n := range nm.Step(s, input, output) {
					add(out, n)
				}
			}
			return len(out) > 0, out
		},
		Equal: func(a, b any) bool {
			x, y := a.(set), b.(set)
			if len(x) != len(y) {
				return false
			}
			for k, s := range x {
				if t, ok := y[k]; !ok || t != s {
					return false
				}
			}
			return true
		},
		Hash: func(state any) uint64 {
			var h uint64
			for _, s := range state.(set) {
				h += maphash.Comparable(seed, s) // order-independent
			}
			return h
		},
		DescribeOperation: nm.DescribeOperation,
		DescribeState: func(state any) string {
			d := ""
			for _, s := range state.(set) {
				if d != "" {
					d += " | "
				}
				d += nm.DescribeState(s)
			}
			return d
		},
	}
}
