package moe

import (
	"math"
	"reflect"
	"testing"
)

// meanStd returns the mean and the standard deviation of x.
func meanStd(x []float32) (float64, float64) {
	var s, s2 float64
	for _, v := range x {
		s += float64(v)
		s2 += float64(v) * float64(v)
	}
	n := float64(len(x))
	m := s / n
	return m, math.Sqrt(max(s2/n-m*m, 0))
}

func TestRandomWeightsDist(t *testing.T) {
	cfg := variants()["deepseek_v3"]
	uni, err := RandomWeights(cfg, 7)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		dist    InitDist
		std     float64 // of the expert weights
		biasStd float64
	}{
		// U(±b) has standard deviation b/sqrt(3); b = 1/sqrt(H=16) = 0.25
		{"uniform", InitUniform, 0.25 / math.Sqrt(3), 0.05 / math.Sqrt(3)},
		{"normal", InitNormal, InitNormalStd, InitNormalStd},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w, err := RandomWeightsDist(cfg, 7, c.dist)
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Check(cfg); err != nil {
				t.Fatal(err)
			}
			again, _ := RandomWeightsDist(cfg, 7, c.dist)
			if !reflect.DeepEqual(w, again) {
				t.Error("same seed and distribution, different weights")
			}
			if reflect.DeepEqual(w, uni) != (c.dist == InitUniform) {
				t.Errorf("%s: equal to RandomWeights = %v", c.dist, c.dist != InitUniform)
			}
			var all []float32
			for _, e := range w.Experts {
				all = append(all, e.Gate...)
				all = append(all, e.Up...)
			}
			m, s := meanStd(all)
			if math.Abs(m) > 0.1*c.std || math.Abs(s-c.std) > 0.1*c.std {
				t.Errorf("expert weights: mean %.4g std %.4g, want 0 and %.4g", m, s, c.std)
			}
			if _, bs := meanStd(w.Bias); math.Abs(bs-c.biasStd) > 0.5*c.biasStd {
				t.Errorf("bias std %.4g, want about %.4g", bs, c.biasStd)
			}
			if got, err := ParseInitDist(c.dist.String()); err != nil || got != c.dist {
				t.Errorf("ParseInitDist(%q) = %v, %v", c.dist.String(), got, err)
			}
		})
	}
	if _, err := ParseInitDist("gauss"); err == nil {
		t.Error("ParseInitDist(gauss): want an error")
	}
	if _, err := RandomWeightsDist(&Config{}, 1, InitNormal); err == nil {
		t.Error("invalid config: want an error")
	}
}
