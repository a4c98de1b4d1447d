//! Walks over objects that follow their kind's list and map semantics: the fields a value sets,
//! what changed between two versions, merging an applied configuration, removing fields.

use std::collections::HashSet;

use serde_json::{Map, Value};

use super::fieldset::{Element, FieldPath, FieldSet, path_string};
use super::schema::{ListSemantics, ListType, PathElem};

/// Where a walk is: the schema path (for semantics) and the field path (for ownership).
#[derive(Debug, Clone, Default)]
struct Cursor {
    schema: Vec<PathElem>,
    field: FieldPath,
}

impl Cursor {
    fn is_root(&self) -> bool {
        self.field.is_empty()
    }

    fn push_field(&mut self, name: &str) {
        self.schema.push(PathElem::Field(name.to_string()));
        self.field.push(Element::Field(name.to_string()));
    }

    fn push_item(&mut self, element: Element) {
        self.schema.push(PathElem::Item);
        self.field.push(element);
    }

    fn pop(&mut self) {
        self.schema.pop();
        self.field.pop();
    }
}

/// The path element naming `item` of the non-atomic list at `list`.
fn item_element(
    schema: &dyn ListSemantics,
    list: &[PathElem],
    list_type: &ListType,
    item: &Value,
) -> Result<Element, String> {
    match (list_type, item) {
        (ListType::Map(keys), Value::Object(fields)) => {
            let mut key = Map::new();
            for name in keys {
                let value = fields
                    .get(name)
                    .filter(|value| !value.is_null())
                    .cloned()
                    .or_else(|| schema.key_default(list, name));
                if let Some(value) = value {
                    key.insert(name.clone(), value);
                }
            }
            if key.is_empty() {
                return Err(format!(
                    "an item of the associative list {} lacks its key fields {keys:?}",
                    super::schema::render(list)
                ));
            }
            Ok(Element::Key(Value::Object(key).to_string()))
        }
        (ListType::Set, Value::Object(_) | Value::Array(_)) => {
            Err(format!("the set {} may only hold scalars", super::schema::render(list)))
        }
        (ListType::Set, scalar) => Ok(Element::Value(scalar.to_string())),
        (_, _) => Err(format!(
            "the associative list {} may only hold objects",
            super::schema::render(list)
        )),
    }
}

/// Pairs each item of a non-atomic list with its path element, refusing duplicates.
fn keyed_items<'v>(
    schema: &dyn ListSemantics,
    cursor: &Cursor,
    list_type: &ListType,
    items: &'v [Value],
) -> Result<Vec<(Element, &'v Value)>, String> {
    let mut seen = HashSet::new();
    let mut keyed = Vec::with_capacity(items.len());
    for item in items {
        let element = item_element(schema, &cursor.schema, list_type, item)?;
        if !seen.insert(element.clone()) {
            let mut duplicate = cursor.field.clone();
            duplicate.push(element);
            return Err(format!("duplicate entries for {}", path_string(&duplicate)));
        }
        keyed.push((element, item));
    }
    Ok(keyed)
}

/// Collects the paths of a value. With `include_nodes`, every object and list on the way is
/// in the set too (what an Update changes); without, only what an applier owns: leaves, list
/// items, map keys, atomic lists and maps.
struct Collector<'a> {
    schema: &'a dyn ListSemantics,
    include_nodes: bool,
    set: FieldSet,
}

impl Collector<'_> {
    fn insert(&mut self, cursor: &Cursor) {
        if !cursor.is_root() {
            self.set.insert(cursor.field.clone());
        }
    }

    fn walk(&mut self, value: &Value, cursor: &mut Cursor) -> Result<(), String> {
        match value {
            Value::Object(fields) => self.walk_object(fields, cursor),
            Value::Array(items) => self.walk_list(items, cursor),
            _ => {
                self.insert(cursor);
                Ok(())
            }
        }
    }

    fn walk_object(&mut self, fields: &Map<String, Value>, cursor: &mut Cursor) -> Result<(), String> {
        let atomic = !cursor.is_root() && self.schema.map_is_atomic(&cursor.schema);
        if atomic || self.include_nodes {
            self.insert(cursor);
        }
        if atomic {
            return Ok(());
        }
        self.walk_fields(fields, cursor)
    }

    /// Named fields of a struct are owned through their leaves only, but the keys of a map are
    /// owned themselves, whatever their values (so an empty struct is owned by nobody).
    fn walk_fields(&mut self, fields: &Map<String, Value>, cursor: &mut Cursor) -> Result<(), String> {
        let keys_are_owned = self.schema.is_map(&cursor.schema);
        for (name, value) in fields.iter().filter(|(_, value)| !value.is_null()) {
            cursor.push_field(name);
            if keys_are_owned {
                self.insert(cursor);
            }
            let walked = self.walk(value, cursor);
            cursor.pop();
            walked?;
        }
        Ok(())
    }

    fn walk_list(&mut self, items: &[Value], cursor: &mut Cursor) -> Result<(), String> {
        let list_type = self.schema.list_type(&cursor.schema);
        if list_type == ListType::Atomic || self.include_nodes {
            self.insert(cursor);
        }
        if list_type == ListType::Atomic {
            return Ok(());
        }
        for (element, item) in keyed_items(self.schema, cursor, &list_type, items)? {
            self.walk_item(element, item, cursor)?;
        }
        Ok(())
    }

    fn walk_item(&mut self, element: Element, item: &Value, cursor: &mut Cursor) -> Result<(), String> {
        cursor.push_item(element);
        self.insert(cursor);
        let walked = match item {
            Value::Object(fields) => self.walk_fields(fields, cursor),
            _ => Ok(()),
        };
        cursor.pop();
        walked
    }
}

/// The fields an applied configuration sets, which its applier owns.
pub(crate) fn owned_by_config(value: &Value, schema: &dyn ListSemantics) -> Result<FieldSet, String> {
    collect(value, schema, false, &mut Cursor::default())
}

/// Every path of a value, parents included: what creating it adds.
pub(crate) fn all_paths(value: &Value, schema: &dyn ListSemantics) -> Result<FieldSet, String> {
    collect(value, schema, true, &mut Cursor::default())
}

fn collect(
    value: &Value,
    schema: &dyn ListSemantics,
    include_nodes: bool,
    cursor: &mut Cursor,
) -> Result<FieldSet, String> {
    let mut collector = Collector {
        schema,
        include_nodes,
        set: FieldSet::new(),
    };
    collector.walk(value, cursor)?;
    Ok(collector.set)
}

/// What changed between two versions of an object, path by path.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Comparison {
    pub added: FieldSet,
    pub removed: FieldSet,
    pub modified: FieldSet,
}

impl Comparison {
    /// Fields whose value is new: what a writer takes from other managers.
    pub(super) fn changed(&self) -> FieldSet {
        self.added.union(&self.modified)
    }
}

/// Compares two versions of an object, not looking into the fields `skip` names (nor what they
/// hold). A field whose two versions are equal is not walked: nothing in it changed. So a list in
/// it that breaks its semantics (duplicate keys) goes unnoticed, as it costs no ownership.
pub(crate) fn compare(
    old: &Value,
    new: &Value,
    schema: &dyn ListSemantics,
    skip: fn(&[Element]) -> bool,
) -> Result<Comparison, String> {
    let mut comparer = Comparer {
        schema,
        skip,
        comparison: Comparison::default(),
    };
    comparer.compare(Some(old), Some(new), &mut Cursor::default())?;
    Ok(comparer.comparison)
}

struct Comparer<'a> {
    schema: &'a dyn ListSemantics,
    skip: fn(&[Element]) -> bool,
    comparison: Comparison,
}

impl Comparer<'_> {
    fn compare(&mut self, old: Option<&Value>, new: Option<&Value>, cursor: &mut Cursor) -> Result<(), String> {
        let old = old.filter(|value| !value.is_null());
        let new = new.filter(|value| !value.is_null());
        match (old, new) {
            (None, None) => Ok(()),
            (None, Some(new)) => {
                let added = collect(new, self.schema, true, &mut cursor.clone())?;
                self.comparison.added.extend(added);
                Ok(())
            }
            (Some(old), None) => {
                let removed = collect(old, self.schema, true, &mut cursor.clone())?;
                self.comparison.removed.extend(removed);
                Ok(())
            }
            (Some(Value::Object(old)), Some(Value::Object(new)))
                if cursor.is_root() || !self.schema.map_is_atomic(&cursor.schema) =>
            {
                self.compare_objects(old, new, cursor)
            }
            (Some(Value::Array(old)), Some(Value::Array(new))) => self.compare_lists(old, new, cursor),
            (Some(old), Some(new)) => {
                if old != new {
                    self.comparison.modified.insert(cursor.field.clone());
                }
                Ok(())
            }
        }
    }

    fn compare_objects(
        &mut self,
        old: &Map<String, Value>,
        new: &Map<String, Value>,
        cursor: &mut Cursor,
    ) -> Result<(), String> {
        // The results are sets, so the order fields are visited in does not matter.
        let names = old.keys().chain(new.keys().filter(|name| !old.contains_key(*name)));
        for name in names {
            if old.get(name) == new.get(name) {
                continue;
            }
            cursor.push_field(name);
            if (self.skip)(&cursor.field) {
                cursor.pop();
                continue;
            }
            let compared = self.compare(old.get(name), new.get(name), cursor);
            cursor.pop();
            compared?;
        }
        Ok(())
    }

    fn compare_lists(&mut self, old: &[Value], new: &[Value], cursor: &mut Cursor) -> Result<(), String> {
        let list_type = self.schema.list_type(&cursor.schema);
        if list_type == ListType::Atomic {
            if old != new {
                self.comparison.modified.insert(cursor.field.clone());
            }
            return Ok(());
        }
        let old_items = keyed_items(self.schema, cursor, &list_type, old)?;
        let new_items = keyed_items(self.schema, cursor, &list_type, new)?;
        for (element, new_item) in &new_items {
            let old_item = old_items.iter().find(|(old, _)| old == element).map(|(_, item)| *item);
            self.compare_item(element, old_item, Some(new_item), cursor)?;
        }
        for (element, old_item) in &old_items {
            if !new_items.iter().any(|(new, _)| new == element) {
                self.compare_item(element, Some(old_item), None, cursor)?;
            }
        }
        Ok(())
    }

    fn compare_item(
        &mut self,
        element: &Element,
        old: Option<&Value>,
        new: Option<&Value>,
        cursor: &mut Cursor,
    ) -> Result<(), String> {
        if old.is_some() && old == new {
            return Ok(());
        }
        cursor.push_item(element.clone());
        let compared = match (old, new) {
            (Some(Value::Object(old)), Some(Value::Object(new))) => self.compare_objects(old, new, cursor),
            (Some(_), Some(_)) => Ok(()),
            (old, new) => self.compare_lone_item(old, new, cursor),
        };
        cursor.pop();
        compared
    }

    /// An item present on one side only is added or removed with everything in it.
    fn compare_lone_item(
        &mut self,
        old: Option<&Value>,
        new: Option<&Value>,
        cursor: &mut Cursor,
    ) -> Result<(), String> {
        let (value, into_added) = match (old, new) {
            (None, Some(new)) => (new, true),
            (Some(old), None) => (old, false),
            _ => return Ok(()),
        };
        let mut paths = FieldSet::new();
        paths.insert(cursor.field.clone());
        if let Value::Object(fields) = value {
            let mut collector = Collector {
                schema: self.schema,
                include_nodes: true,
                set: paths,
            };
            collector.walk_fields(fields, cursor)?;
            paths = collector.set;
        }
        let target = if into_added {
            &mut self.comparison.added
        } else {
            &mut self.comparison.removed
        };
        target.extend(paths);
        Ok(())
    }
}

/// Merges an applied configuration into the live object: objects field by field, associative
/// lists item by item, sets by value; atomic lists and maps and scalars are replaced.
pub(crate) fn merge(live: &Value, config: &Value, schema: &dyn ListSemantics) -> Result<Value, String> {
    merge_values(live, config, schema, &mut Cursor::default())
}

fn merge_values(
    live: &Value,
    config: &Value,
    schema: &dyn ListSemantics,
    cursor: &mut Cursor,
) -> Result<Value, String> {
    match (live, config) {
        (Value::Object(live), Value::Object(config)) if cursor.is_root() || !schema.map_is_atomic(&cursor.schema) => {
            merge_objects(live, config, schema, cursor)
        }
        (Value::Array(live), Value::Array(config)) => match schema.list_type(&cursor.schema) {
            ListType::Atomic => Ok(Value::Array(config.clone())),
            list_type => merge_lists(live, config, &list_type, schema, cursor),
        },
        _ => Ok(config.clone()),
    }
}

fn merge_objects(
    live: &Map<String, Value>,
    config: &Map<String, Value>,
    schema: &dyn ListSemantics,
    cursor: &mut Cursor,
) -> Result<Value, String> {
    let mut merged = live.clone();
    for (name, value) in config {
        cursor.push_field(name);
        let field = match live.get(name) {
            Some(existing) => merge_values(existing, value, schema, cursor),
            None => Ok(value.clone()),
        };
        cursor.pop();
        merged.insert(name.clone(), field?);
    }
    Ok(Value::Object(merged))
}

/// Items the configuration names come out in its order, merged with their live versions; live
/// items it does not name keep their place among them (structured-merge-diff's interleaving).
fn merge_lists(
    live: &[Value],
    config: &[Value],
    list_type: &ListType,
    schema: &dyn ListSemantics,
    cursor: &mut Cursor,
) -> Result<Value, String> {
    let live = keyed_items(schema, cursor, list_type, live)?;
    let config = keyed_items(schema, cursor, list_type, config)?;
    let live_value = |wanted: &Element| live.iter().find(|(e, _)| e == wanted).map(|(_, v)| *v);
    let in_config = |wanted: &Element| config.iter().any(|(e, _)| e == wanted);
    let mut shared = config.iter().map(|(e, _)| e).filter(|e| live_value(e).is_some());
    let mut next_shared = shared.next();
    let mut emitted = HashSet::new();
    let mut merged = Vec::with_capacity(live.len() + config.len());
    let (mut l, mut c) = (0, 0);
    while l < live.len() || c < config.len() {
        if let Some((element, value)) = live.get(l) {
            let config_here = config.get(c).is_some_and(|(e, _)| e == element);
            let wanted_later = in_config(element) && next_shared != Some(element);
            if !in_config(element) {
                merged.push((*value).clone());
                l += 1;
                continue;
            }
            if emitted.contains(element) || (!config_here && wanted_later) {
                l += 1;
                continue;
            }
        }
        let Some((element, value)) = config.get(c) else {
            break;
        };
        merged.push(merge_item(live_value(element), element, value, schema, cursor)?);
        emitted.insert(element.clone());
        if next_shared == Some(element) {
            next_shared = shared.next();
        }
        c += 1;
    }
    Ok(Value::Array(merged))
}

fn merge_item(
    live: Option<&Value>,
    element: &Element,
    config: &Value,
    schema: &dyn ListSemantics,
    cursor: &mut Cursor,
) -> Result<Value, String> {
    let Some(live) = live else {
        return Ok(config.clone());
    };
    cursor.push_item(element.clone());
    let merged = merge_values(live, config, schema, cursor);
    cursor.pop();
    merged
}

/// The value at `path`, if there is one.
pub(crate) fn get<'v>(value: &'v Value, path: &[Element], schema: &dyn ListSemantics) -> Option<&'v Value> {
    let mut schema_path = Vec::new();
    let mut current = value;
    for element in path {
        let index = child_index(current, element, &schema_path, schema);
        current = match (element, index) {
            (Element::Field(name), _) => current.get(name)?,
            (_, Some(index)) => current.get(index)?,
            (_, None) => return None,
        };
        schema_path.push(schema_step(element));
    }
    Some(current)
}

/// Removes the field or item at `path`; a missing path is left alone.
pub(crate) fn remove(value: &mut Value, path: &[Element], schema: &dyn ListSemantics) {
    let Some((last, parent_path)) = path.split_last() else {
        return;
    };
    let schema_path: Vec<PathElem> = parent_path.iter().map(schema_step).collect();
    let Some(parent) = get_mut(value, parent_path, schema) else {
        return;
    };
    match (last, parent) {
        (Element::Field(name), Value::Object(fields)) => {
            fields.remove(name);
        }
        (element, parent) => {
            if let Some(index) = child_index(parent, element, &schema_path, schema)
                && let Value::Array(items) = parent
            {
                items.remove(index);
            }
        }
    }
}

fn get_mut<'v>(value: &'v mut Value, path: &[Element], schema: &dyn ListSemantics) -> Option<&'v mut Value> {
    let mut schema_path = Vec::new();
    let mut current = value;
    for element in path {
        let index = child_index(current, element, &schema_path, schema);
        current = match (element, index) {
            (Element::Field(name), _) => current.get_mut(name)?,
            (_, Some(index)) => current.get_mut(index)?,
            (_, None) => return None,
        };
        schema_path.push(schema_step(element));
    }
    Some(current)
}

fn schema_step(element: &Element) -> PathElem {
    match element {
        Element::Field(name) => PathElem::Field(name.clone()),
        _ => PathElem::Item,
    }
}

/// The position of the list item `element` names in `list`, if `list` is a list holding it.
fn child_index(list: &Value, element: &Element, list_path: &[PathElem], schema: &dyn ListSemantics) -> Option<usize> {
    let items = list.as_array()?;
    match element {
        Element::Field(_) => None,
        Element::Index(index) => (*index < items.len()).then_some(*index),
        Element::Key(_) | Element::Value(_) => {
            let list_type = schema.list_type(list_path);
            items
                .iter()
                .position(|item| item_element(schema, list_path, &list_type, item).as_ref() == Ok(element))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::patch_engine::builtin::BuiltinSchema;
    use serde_json::json;

    fn paths(set: &FieldSet) -> Vec<String> {
        set.iter().map(|path| path_string(path)).collect()
    }

    #[test]
    fn config_ownership_is_leaves_and_list_items() {
        let pod = json!({"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [
            {"name": "app", "image": "app:1", "args": ["a"]}
        ]}});
        let owned = owned_by_config(&pod, &BuiltinSchema::for_kind("Pod"));
        assert_eq!(
            owned.as_ref().map(paths),
            Ok(vec![
                ".metadata.labels.app".to_string(),
                r#".spec.containers[name="app"]"#.to_string(),
                r#".spec.containers[name="app"].args"#.to_string(),
                r#".spec.containers[name="app"].image"#.to_string(),
                r#".spec.containers[name="app"].name"#.to_string(),
            ])
        );
    }

    #[test]
    fn comparison_reports_added_removed_and_modified() {
        let schema = BuiltinSchema::for_kind("ConfigMap");
        let old = json!({"data": {"a": "1", "b": "2"}});
        let new = json!({"data": {"a": "9", "c": "3"}, "metadata": {"labels": {"x": "y"}}});
        let comparison = compare(&old, &new, &schema, |_| false).unwrap_or_default();
        assert_eq!(paths(&comparison.modified), vec![".data.a"]);
        assert_eq!(paths(&comparison.removed), vec![".data.b"]);
        assert_eq!(
            paths(&comparison.added),
            vec![".data.c", ".metadata", ".metadata.labels", ".metadata.labels.x"]
        );
    }

    #[test]
    fn map_list_items_are_removed_by_key() {
        let schema = BuiltinSchema::for_kind("Pod");
        let mut pod = json!({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        let path = vec![
            Element::Field("spec".into()),
            Element::Field("containers".into()),
            Element::Key(r#"{"name":"a"}"#.into()),
        ];
        remove(&mut pod, &path, &schema);
        assert_eq!(pod, json!({"spec": {"containers": [{"name": "b"}]}}));
    }

    #[test]
    fn applied_order_wins_and_live_only_items_keep_their_place() {
        let schema = BuiltinSchema::for_kind("Pod");
        let containers = |names: &[&str]| -> Value {
            let items: Vec<Value> = names.iter().map(|n| json!({"name": n})).collect();
            json!({"spec": {"containers": items}})
        };
        let merged = merge(
            &containers(&["x", "a", "b", "y"]),
            &containers(&["b", "a", "n"]),
            &schema,
        );
        assert_eq!(merged, Ok(containers(&["x", "b", "y", "a", "n"])));
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let schema = BuiltinSchema::for_kind("Pod");
        let pod = json!({"spec": {"containers": [{"name": "a"}, {"name": "a"}]}});
        assert!(owned_by_config(&pod, &schema).is_err());
    }

    #[test]
    fn ports_without_protocol_match_stored_tcp_ports() {
        let schema = BuiltinSchema::for_kind("Pod");
        let live = json!({"spec": {"containers": [{"name": "a", "ports": [
            {"containerPort": 80, "protocol": "TCP", "name": "http"}
        ]}]}});
        let config = json!({"spec": {"containers": [{"name": "a", "ports": [
            {"containerPort": 80, "name": "web"}
        ]}]}});
        let merged = merge(&live, &config, &schema);
        assert_eq!(
            merged.map(|merged| merged["spec"]["containers"][0]["ports"].clone()),
            Ok(json!([{"containerPort": 80, "protocol": "TCP", "name": "web"}]))
        );
    }
}
