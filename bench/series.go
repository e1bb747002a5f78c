package main

import "fmt"

// keep stores a series of rates under scenario/variant/clients for the ratio
// rows computed at the end.
func (b *bench) keep(scenario, variant string, clients int, rates []float64) {
	if b.series == nil {
		b.series = map[string][]float64{}
	}
	if len(rates) > 0 {
		b.series[seriesKey(scenario, variant, clients)] = rates
	}
}

func (b *bench) get(scenario, variant string, clients int) []float64 {
	return b.series[seriesKey(scenario, variant, clients)]
}

func seriesKey(scenario, variant string, clients int) string {
	return fmt.Sprintf("%s/%s/%d", scenario, variant, clients)
}
