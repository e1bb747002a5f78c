package main

import (
	"context"
	"fmt"
)

// b1Commits is the number of commits in one B1 cycle: acquire, fenced
// write, release.
const b1Commits = 3

// runCore measures L0 (the physical limit) and, interleaved with it, B1 and
// P1/P2/P3 on distinct keys, so that B1's ratios to L0, etcd and Redis compare
// runs made side by side.
func (b *bench) runCore(ctx context.Context) error {
	if err := setupL0(ctx, b.pg.pool); err != nil {
		return fmt.Errorf("L0 setup: %w", err)
	}
	env, b1Err := b.setupB1(ctx)
	if env != nil {
		defer env.close()
	}
	var vs []variant
	var own []int // indexes of the L0 and B1 variants
	for _, c := range b.allClients() {
		if b.b1Only(c) {
			// A --b1-clients count: B1 acquire+release (one process and
			// across processes) with what its ratios need, L0 random row and
			// P3 distinct keys.
			if b.want("B1") {
				own = append(own, len(vs))
				vs = append(vs, l0Variant(b.pg.pool, false, c))
				for _, v := range b.b1Variants(env, c) {
					if v.name == keyB1Bare {
						own = append(own, len(vs))
						vs = append(vs, v)
					}
				}
				if c >= b1Procs {
					own = append(own, len(vs))
					vs = append(vs, b.b1ProcsVariant(c))
				}
				if b.redisAOFAddr != "" {
					for _, p := range b.redisPeers() {
						if p.key == keyP3 {
							vs = append(vs, b.redisPeerVariant(p, false, c))
						}
					}
				}
			}
			continue
		}
		if b.want("L0") || b.want("B1") {
			own = append(own, len(vs), len(vs)+1)
			vs = append(vs, l0Variant(b.pg.pool, false, c), l0Variant(b.pg.pool, true, c))
		}
		if b.want("B1") {
			for _, v := range b.b1Variants(env, c) {
				own = append(own, len(vs))
				vs = append(vs, v)
			}
			if c >= b1Procs {
				own = append(own, len(vs))
				vs = append(vs, b.b1ProcsVariant(c))
			}
		}
		if b.etcd != nil {
			vs = append(vs, b.p1Variant(false, c))
		}
		vs = append(vs, b.redisVariants(false, c)...)
	}
	res := b.measure(ctx, "core", vs)
	if len(own) == 0 {
		return nil
	}
	byKey := map[string]series{}
	for _, i := range own {
		v := vs[i]
		byKey[seriesKey("", v.name, v.clients)] = res[i]
		b.keep(keyForVariant(v.name), v.name, v.clients, res[i].rates)
	}
	for _, c := range b.allClients() {
		for _, name := range []string{keyL0Random, "hot row"} {
			s, ok := byKey[seriesKey("", name, c)]
			if !ok {
				continue
			}
			b.add(rateRow("L0 UPDATE limit", name, c, "ops/s", s))
			if c == 1 {
				b.memRow("L0 UPDATE "+name, s)
			}
		}
	}
	const scen = "B1 distinct names"
	if !b.want("B1") {
		return nil
	}
	if b1Err != nil || env == nil {
		why := "pglock/fencedwrite not merged yet"
		if b1Err != nil {
			why = b1Err.Error()
		}
		b.add(notMeasured(scen, keyB1Full, 0, "cycles/s", why))
		return nil
	}
	limit := func(c int, commits float64) []float64 {
		l0 := byKey[seriesKey("", keyL0Random, c)].rates
		out := make([]float64, len(l0))
		for i, v := range l0 {
			out[i] = v / commits
		}
		return out
	}
	for _, c := range b.allClients() {
		for _, v := range []struct {
			name    string
			commits float64
		}{{keyB1Full, b1Commits}, {keyB1Bare, 2}, {keyB1Procs, 2}} {
			s, ok := byKey[seriesKey("", v.name, c)]
			if !ok {
				continue
			}
			r := rateRow(scen, v.name, c, "cycles/s", s)
			goal := b1GoalOfLimit
			if v.name == keyB1Procs && c != 32 {
				goal = 0 // the goal across processes is at 32 clients
			}
			if rs := pairedRatios(s.rates, limit(c, v.commits)); len(rs) > 0 && r.Measured() {
				m, _, _ := summarize(rs)
				r = r.withRatio(m, fmt.Sprintf("÷ (L0 random ÷ %.0f commits)", v.commits), goal)
				switch {
				case v.name == keyB1Full:
					b.b1Goal.addRatio(fmt.Sprintf("c=%d", c), r)
				case v.name == keyB1Procs && goal > 0:
					b.b1ProcsGoal.addRatio(fmt.Sprintf("c=%d", c), r)
				}
			}
			b.add(r)
			if c == 1 {
				b.memRow("B1 "+v.name, s)
			}
		}
	}
	return nil
}

func keyForVariant(name string) string {
	switch name {
	case keyB1Full, keyB1Bare, keyB1Procs:
		return keyB1
	}
	return keyL0
}
