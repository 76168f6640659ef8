// promql-check: parse PromQL expressions with Prometheus's own parser (github.com/prometheus/
// prometheus/promql/parser) and name the metrics each selects. Reads a JSON list of expressions on
// stdin, writes a JSON list of {"metrics": [...], "error": "..."} in the same order. The chart's
// dashboard, alert rules and adapter queries are checked with it (tests/unit/operator/
// test_observability_chart.py): each parses, and each metric it names is one something exports.
// Also the label names each selector matches on and each aggregation groups by, with the metrics
// beneath it, so the test can check those labels are ones the metrics carry.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type selector struct {
	Metric string   `json:"metric"`
	Labels []string `json:"labels"`
}

type grouping struct {
	By      []string `json:"by"`
	Without bool     `json:"without"`
	Metrics []string `json:"metrics"`
}

type result struct {
	Metrics   []string   `json:"metrics"`
	Selectors []selector `json:"selectors"`
	Groupings []grouping `json:"groupings"`
	Error     string     `json:"error,omitempty"`
}

func selectorName(vs *parser.VectorSelector) string {
	name := vs.Name
	for _, m := range vs.LabelMatchers {
		if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
			name = m.Value
		}
	}
	if name == "" {
		name = "<no metric name: " + vs.String() + ">"
	}
	return name
}

func sorted(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for n := range set {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// labelUses: the selectors' matcher labels and the aggregations' grouping labels.
func labelUses(node parser.Node) ([]selector, []grouping) {
	var sels []selector
	var groups []grouping
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		switch v := n.(type) {
		case *parser.VectorSelector:
			names := map[string]bool{}
			for _, m := range v.LabelMatchers {
				if m.Name != labels.MetricName {
					names[m.Name] = true
				}
			}
			sels = append(sels, selector{Metric: selectorName(v), Labels: sorted(names)})
		case *parser.AggregateExpr:
			beneath := map[string]bool{}
			parser.Inspect(v.Expr, func(m parser.Node, _ []parser.Node) error {
				if vs, ok := m.(*parser.VectorSelector); ok {
					beneath[selectorName(vs)] = true
				}
				return nil
			})
			by := append([]string{}, v.Grouping...)
			sort.Strings(by)
			groups = append(groups, grouping{By: by, Without: v.Without, Metrics: sorted(beneath)})
		}
		return nil
	})
	return sels, groups
}

func metrics(expr string) ([]string, error) {
	node, err := parser.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		seen[selectorName(vs)] = true
		return nil
	})
	return sorted(seen), nil
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "stdin: a JSON list of PromQL expressions:", err)
		os.Exit(2)
	}
	out := make([]result, len(exprs))
	for i, e := range exprs {
		names, err := metrics(e)
		out[i].Metrics = names
		if err != nil {
			out[i].Error = err.Error()
			continue
		}
		node, _ := parser.ParseExpr(e)
		out[i].Selectors, out[i].Groupings = labelUses(node)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
