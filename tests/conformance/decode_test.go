package conformance

import (
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	rplan "github.com/rancher/rancher/pkg/plan"
	corev1 "k8s.io/api/core/v1"
)

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// strict decodes JSON into v, refusing fields v does not declare: a key Rancher's type does not
// know is a failure, not something silently dropped.
func strict(raw []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return fmt.Errorf("trailing data after the JSON value")
	}
	return nil
}

func gunzip(raw []byte) ([]byte, error) {
	r, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		return nil, err
	}
	return io.ReadAll(r)
}

// decodeOneTimeOutput reads applied-output / failed-output: gzip of a JSON map of instruction
// name to bytes (Go []byte, so base64 strings). Empty is no output.
func decodeOneTimeOutput(raw []byte) (map[string][]byte, error) {
	return decodeGzipMap[[]byte](raw)
}

// decodePeriodicOutput reads applied-periodic-output into Rancher's PeriodicInstructionOutput.
func decodePeriodicOutput(raw []byte) (map[string]rplan.PeriodicInstructionOutput, error) {
	return decodeGzipMap[rplan.PeriodicInstructionOutput](raw)
}

// decodeGzipMap reads gzip of a JSON map of name to V, strictly. Empty is an empty map.
func decodeGzipMap[V any](raw []byte) (map[string]V, error) {
	out := map[string]V{}
	if len(raw) == 0 {
		return out, nil
	}
	j, err := gunzip(raw)
	if err != nil {
		return nil, err
	}
	return out, strict(j, &out)
}

// decodeCheckpoint reads plan-checkpoint into the checkpoint struct; empty means none.
func decodeCheckpoint(raw []byte) (*checkpoint, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var c checkpoint
	return &c, strict(raw, &c)
}

// agentKeys are the data keys an agent may write, each with the check of its encoding.
var agentKeys = map[string]func(s *corev1.Secret, raw []byte) error{
	"plan-state": func(_ *corev1.Secret, raw []byte) error {
		if !knownStates[planState(raw)] {
			return fmt.Errorf("not one of Rancher's plan states: %q", raw)
		}
		return nil
	},
	"plan-checkpoint": func(s *corev1.Secret, raw []byte) error {
		c, err := decodeCheckpoint(raw)
		if err != nil || c == nil {
			return err
		}
		if want := rplan.Checksum(s.Data[keyPlan]); c.Checksum != want {
			return fmt.Errorf("checkpoint of plan %s, the Secret's plan is %s", c.Checksum, want)
		}
		if c.ResumeState != "" && !knownStates[c.ResumeState] {
			return fmt.Errorf("resumeState %q is not a plan state", c.ResumeState)
		}
		return nil
	},
	"probe-statuses": func(_ *corev1.Secret, raw []byte) error {
		m := map[string]rplan.ProbeStatus{}
		return strict(raw, &m)
	},
	"applied-output": func(_ *corev1.Secret, raw []byte) error { _, err := decodeOneTimeOutput(raw); return err },
	"failed-output":  func(_ *corev1.Secret, raw []byte) error { _, err := decodeOneTimeOutput(raw); return err },
	"applied-periodic-output": func(_ *corev1.Secret, raw []byte) error {
		m, err := decodePeriodicOutput(raw)
		for name, o := range m {
			for _, t := range []string{o.LastSuccessfulRunTime, o.LastFailedRunTime} {
				if t == "" {
					continue
				}
				if _, err := time.Parse(time.UnixDate, t); err != nil {
					return fmt.Errorf("%s: %v", name, err)
				}
			}
		}
		return err
	},
	"last-apply-time": func(_ *corev1.Secret, raw []byte) error {
		_, err := time.Parse(time.UnixDate, string(raw))
		return err
	},
	"applied-checksum": checksumOrEmpty,
	"failed-checksum":  checksumOrEmpty,
	// nodeplan's own key (Rancher neither reads nor writes it): what made the plan of
	// failed-checksum fail; empty after a success.
	"failed-instruction": func(s *corev1.Secret, raw []byte) error {
		if len(raw) == 0 {
			return nil
		}
		var f struct {
			Checksum    string   `json:"checksum"`
			Instruction int      `json:"instruction"`
			Total       int      `json:"total"`
			Name        string   `json:"name"`
			Outcome     string   `json:"outcome"`
			LastLines   []string `json:"lastLines"`
		}
		if err := strict(raw, &f); err != nil {
			return err
		}
		if f.Checksum != string(s.Data["failed-checksum"]) || f.Instruction < 1 || f.Instruction > f.Total || f.Outcome == "" {
			return fmt.Errorf("not the failure of failed-checksum %q: %s", s.Data["failed-checksum"], raw)
		}
		return nil
	},
	"failure-count": integer,
	"success-count": integer,
	"plan-revision": integer,
}

func checksumOrEmpty(s *corev1.Secret, raw []byte) error {
	if len(raw) == 0 || string(raw) == rplan.Checksum(s.Data[keyPlan]) {
		return nil
	}
	return fmt.Errorf("%q is neither empty nor the plan's checksum", raw)
}

func integer(_ *corev1.Secret, raw []byte) error {
	_, err := strconv.Atoi(string(raw))
	return err
}

// agentManager is the field manager the API server names the agent's writes after: the product
// of its User-Agent (nodeplan/<version>).
const agentManager = "nodeplan"

// rancherKeys are the data keys Rancher writes (and the agent only reads).
var rancherKeys = map[string]bool{keyPlan: true, keyMaxFailures: true, keyFailureThreshold: true, keyAppliedPlan: true, "probe-period-seconds": true}

// rancherOnlyAnnotations are never the agent's to write.
var rancherOnlyAnnotations = []string{annWriter, annAttempt, annPaused, annCanceled, annProbesPassed, annLastUpdated}

// owned lists the fields a managedFields entry owns under prefix ("f:data", or "f:metadata" then
// "f:annotations"), without the "f:".
func owned(fieldsV1 []byte, path ...string) []string {
	var m map[string]json.RawMessage
	if json.Unmarshal(fieldsV1, &m) != nil {
		return nil
	}
	for _, p := range path {
		raw, ok := m[p]
		if !ok {
			return nil
		}
		m = nil
		if json.Unmarshal(raw, &m) != nil {
			return nil
		}
	}
	var out []string
	for k := range m {
		if strings.HasPrefix(k, "f:") {
			out = append(out, strings.TrimPrefix(k, "f:"))
		}
	}
	sort.Strings(out)
	return out
}

// checkAgentWrites decodes every key of the Secret with Rancher's types, and checks from the
// API server's managedFields that the agent wrote only agent keys: never the plan, the failure
// limits, plan.cattle.io/writer, plan.cattle.io/attempt, the pause/cancel annotations or the
// plan-secret controller's stamps. The agent's field managers and the data keys they own are
// logged.
func checkAgentWrites(t *testing.T, s *corev1.Secret) {
	t.Helper()
	problems, owners := agentWriteProblems(s)
	for _, p := range problems {
		t.Error(p)
	}
	for m := range owners {
		if m != agentManager {
			t.Errorf("field manager %q is neither Rancher's (%s) nor the agent's (%s)", m, userAgent, agentManager)
		}
	}
	if _, ok := owners[agentManager]; !ok {
		t.Errorf("no field manager %q: the agent's writes are not named after it", agentManager)
	}
	t.Logf("the agent's field managers and the data keys they own: %v", owners)
}

// agentWriteProblems is checkAgentWrites' verdict: what is wrong, and each field manager other
// than Rancher's with the data keys it owns.
func agentWriteProblems(s *corev1.Secret) ([]string, map[string][]string) {
	var problems []string
	for key, raw := range s.Data {
		if rancherKeys[key] {
			continue
		}
		check, ok := agentKeys[key]
		if !ok {
			problems = append(problems, fmt.Sprintf("key %q is in no table of docs/rancher-keys.md (value %q)", key, raw))
			continue
		}
		if err := check(s, raw); err != nil {
			problems = append(problems, fmt.Sprintf("key %q cannot be read as Rancher reads it: %v (value %q)", key, err, raw))
		}
	}
	owners := map[string][]string{}
	for _, mf := range s.ManagedFields {
		if strings.HasPrefix(mf.Manager, userAgent) || mf.FieldsV1 == nil {
			continue
		}
		owners[mf.Manager] = append(owners[mf.Manager], owned(mf.FieldsV1.Raw, "f:data")...)
		for _, a := range owned(mf.FieldsV1.Raw, "f:metadata", "f:annotations") {
			for _, forbidden := range rancherOnlyAnnotations {
				if a == forbidden {
					problems = append(problems, fmt.Sprintf("the agent (field manager %q) wrote annotation %s", mf.Manager, a))
				}
			}
		}
		for _, k := range owned(mf.FieldsV1.Raw, "f:data") {
			if rancherKeys[k] {
				problems = append(problems, fmt.Sprintf("the agent (field manager %q) wrote Rancher's key %s", mf.Manager, k))
			}
		}
	}
	if len(owners) == 0 {
		problems = append(problems, "no field manager but Rancher's on the Secret: the agent wrote nothing, or managedFields are not kept")
	}
	return problems, owners
}
