//! Histograms whose observations carry a weight (one `REPORT` stands for many rejections), or
//! whose counts are set whole from a running total (the judge's). The prometheus crate's
//! histograms take one observation at a time; these are exported the same way.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use prometheus::{
    core::{Collector, Desc},
    proto,
};

/// One histogram family with labels, fed with weighted observations or whole counts. Clones
/// share their series (one is registered, the other fed).
#[derive(Clone)]
pub struct WeightedHistogramVec(Arc<Inner>);

struct Inner {
    desc: Desc,
    buckets: Vec<f64>,
    series: Mutex<BTreeMap<Vec<String>, Series>>,
}

#[derive(Clone, Debug, Default)]
struct Series {
    /// Per bucket (not cumulative), then one for +∞.
    counts: Vec<u64>,
    sum: f64,
}

impl WeightedHistogramVec {
    /// A family `name` with `labels` and upper bucket bounds `buckets` (ascending).
    pub fn new(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> Self {
        let desc = Desc::new(
            name.to_owned(),
            help.to_owned(),
            labels.iter().map(|l| (*l).to_owned()).collect(),
            Default::default(),
        )
        .expect("a valid metric description");
        Self(Arc::new(Inner {
            desc,
            buckets,
            series: Mutex::new(BTreeMap::new()),
        }))
    }

    fn with<R>(&self, labels: &[&str], f: impl FnOnce(&mut Series, &[f64]) -> R) -> R {
        let inner = &*self.0;
        let mut series = inner.series.lock().unwrap_or_else(|p| p.into_inner());
        let entry = series
            .entry(labels.iter().map(|l| (*l).to_owned()).collect())
            .or_insert_with(|| Series {
                counts: vec![0; inner.buckets.len() + 1],
                sum: 0.0,
            });
        f(entry, &inner.buckets)
    }

    /// Make the series for `labels` exist (at zero).
    pub fn touch(&self, labels: &[&str]) {
        self.with(labels, |_, _| ());
    }

    /// Observe `value`, `weight` times.
    pub fn observe(&self, labels: &[&str], value: f64, weight: u64) {
        self.with(labels, |s, buckets| {
            let bucket = buckets
                .iter()
                .position(|upper| value <= *upper)
                .unwrap_or(buckets.len());
            s.counts[bucket] = s.counts[bucket].saturating_add(weight);
            s.sum += value * weight as f64;
        });
    }

    /// Replace the series for `labels` with whole counts (per bucket, then +∞) and a sum.
    pub fn set(&self, labels: &[&str], counts: &[u64], sum: f64) {
        self.with(labels, |s, _| {
            for (mine, theirs) in s.counts.iter_mut().zip(counts) {
                *mine = *theirs;
            }
            s.sum = sum;
        });
    }
}

impl Collector for WeightedHistogramVec {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let inner = &*self.0;
        let series = inner.series.lock().unwrap_or_else(|p| p.into_inner());
        let metrics = series
            .iter()
            .map(|(values, s)| {
                let mut cumulative = 0u64;
                let buckets = inner
                    .buckets
                    .iter()
                    .zip(&s.counts)
                    .map(|(upper, count)| {
                        cumulative = cumulative.saturating_add(*count);
                        let mut bucket = proto::Bucket::default();
                        bucket.set_upper_bound(*upper);
                        bucket.set_cumulative_count(cumulative);
                        bucket
                    })
                    .collect();
                let mut histogram = proto::Histogram::default();
                histogram.set_bucket(buckets);
                histogram.set_sample_count(s.counts.iter().fold(0u64, |a, c| a.saturating_add(*c)));
                histogram.set_sample_sum(s.sum);
                // Sorted by name, as the prometheus crate's own metrics are.
                let mut labels: Vec<_> = inner
                    .desc
                    .variable_labels
                    .iter()
                    .zip(values)
                    .map(|(name, value)| {
                        let mut pair = proto::LabelPair::default();
                        pair.set_name(name.clone());
                        pair.set_value(value.clone());
                        pair
                    })
                    .collect();
                labels.sort_by(|a, b| a.name().cmp(b.name()));
                let mut metric = proto::Metric::default();
                metric.set_label(labels);
                metric.set_histogram(histogram);
                metric
            })
            .collect();
        let mut family = proto::MetricFamily::default();
        family.set_name(inner.desc.fq_name.clone());
        family.set_help(inner.desc.help.clone());
        family.set_field_type(proto::MetricType::HISTOGRAM);
        family.set_metric(metrics);
        vec![family]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_observations_render_as_a_histogram() {
        let h = WeightedHistogramVec::new("t_seconds", "test", &["service"], vec![1.0, 5.0]);
        h.observe(&["a"], 3.0, 4);
        h.observe(&["a"], 9.0, 1);
        let registry = prometheus::Registry::new();
        registry.register(Box::new(h.clone())).unwrap();
        let mut text = Vec::new();
        prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &registry.gather(),
            &mut text,
        )
        .unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains("t_seconds_bucket{service=\"a\",le=\"1\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{service=\"a\",le=\"5\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{service=\"a\",le=\"+Inf\"} 5"),
            "{text}"
        );
        assert!(text.contains("t_seconds_sum{service=\"a\"} 21"), "{text}");
        assert!(text.contains("t_seconds_count{service=\"a\"} 5"), "{text}");
    }
}
