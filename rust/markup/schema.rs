//! A request's tool input schemas, reduced to what the XML formats need: each parameter's JSON types.

use serde_json::{Map, Value};

/// The JSON types a parameter's schema allows, as a bit set; empty when the schema says nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Types(u8);

impl Types {
    pub const UNKNOWN: Self = Self(0);
    pub const STRING: Self = Self(1);
    pub const INTEGER: Self = Self(2);
    /// Any JSON number (integers too).
    pub const NUMBER: Self = Self(4);
    pub const BOOLEAN: Self = Self(8);
    pub const NULL: Self = Self(16);
    pub const OBJECT: Self = Self(32);
    pub const ARRAY: Self = Self(64);

    pub fn has(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// A value of these types is written as a JSON string while the model writes it: the schema
    /// allows only strings, or says nothing.
    pub fn is_string(self) -> bool {
        self == Self::UNKNOWN || self == Self::STRING
    }

    fn named(name: &str) -> Self {
        match name {
            "string" => Self::STRING,
            "integer" => Self::INTEGER,
            "number" => Self::NUMBER,
            "boolean" => Self::BOOLEAN,
            "null" => Self::NULL,
            "object" => Self::OBJECT,
            "array" => Self::ARRAY,
            _ => Self::UNKNOWN,
        }
    }

    fn of_value(value: &Value) -> Self {
        match value {
            Value::Null => Self::NULL,
            Value::Bool(_) => Self::BOOLEAN,
            Value::Number(n) if n.is_f64() => Self::NUMBER,
            Value::Number(_) => Self::INTEGER,
            Value::String(_) => Self::STRING,
            Value::Array(_) => Self::ARRAY,
            Value::Object(_) => Self::OBJECT,
        }
    }

    /// The types a (sub)schema allows: `type` (a name or a list), else the branches of
    /// `anyOf` / `oneOf` / `allOf`, else what `enum` / `const` hold, else `properties` / `items`.
    fn of_schema(schema: &Value, depth: u8) -> Self {
        let Value::Object(map) = schema else {
            return Self::UNKNOWN;
        };
        let mut types = match map.get("type") {
            Some(Value::String(name)) => Self::named(name),
            Some(Value::Array(names)) => names
                .iter()
                .filter_map(Value::as_str)
                .fold(Self::UNKNOWN, |acc, name| acc | Self::named(name)),
            _ => Self::UNKNOWN,
        };
        if types == Self::UNKNOWN && depth < 8 {
            for key in ["anyOf", "oneOf", "allOf"] {
                if let Some(Value::Array(branches)) = map.get(key) {
                    for branch in branches {
                        types = types | Self::of_schema(branch, depth + 1);
                    }
                }
            }
        }
        if types == Self::UNKNOWN {
            if let Some(Value::Array(values)) = map.get("enum") {
                types = values
                    .iter()
                    .fold(Self::UNKNOWN, |acc, v| acc | Self::of_value(v));
            } else if let Some(value) = map.get("const") {
                types = Self::of_value(value);
            } else if map.contains_key("properties") {
                types = Self::OBJECT;
            } else if map.contains_key("items") {
                types = Self::ARRAY;
            }
        }
        types
    }
}

impl std::ops::BitOr for Types {
    type Output = Self;

    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// One declared tool: its name and each top-level parameter's types.
#[derive(Debug, Clone)]
pub struct ToolSchema {
    name: Box<str>,
    params: Vec<(Box<str>, Types)>,
}

impl ToolSchema {
    /// The types of parameter `key`; unknown if the schema does not declare it.
    pub fn param(&self, key: &str) -> Types {
        self.params
            .iter()
            .find(|(name, _)| &**name == key)
            .map_or(Types::UNKNOWN, |&(_, types)| types)
    }
}

/// The tools one request declares. Built once per request (not per token); lookups are linear
/// over the few tools and parameters a request has.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    tools: Vec<ToolSchema>,
}

impl ToolSchemas {
    /// From (name, input JSON schema as JSON text) pairs. Lenient: a schema that is not valid
    /// JSON, or not an object with `properties`, declares no parameter types.
    pub fn new<N: AsRef<str>, S: AsRef<str>>(tools: &[(N, S)]) -> Self {
        let tools = tools
            .iter()
            .map(|(name, schema)| {
                let params = match serde_json::from_str::<Value>(schema.as_ref()) {
                    Ok(Value::Object(schema)) => params_of(&schema),
                    _ => Vec::new(),
                };
                ToolSchema {
                    name: name.as_ref().into(),
                    params,
                }
            })
            .collect();
        Self { tools }
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    pub fn len(&self) -> usize {
        self.tools.len()
    }

    pub fn tool(&self, name: &str) -> Option<&ToolSchema> {
        self.tools.iter().find(|tool| &*tool.name == name)
    }

    /// The types of `key` in tool `name`'s schema; unknown for an unknown tool or parameter.
    pub fn param(&self, name: &str, key: &str) -> Types {
        self.tool(name)
            .map_or(Types::UNKNOWN, |tool| tool.param(key))
    }
}

fn params_of(schema: &Map<String, Value>) -> Vec<(Box<str>, Types)> {
    let Some(Value::Object(properties)) = schema.get("properties") else {
        return Vec::new();
    };
    properties
        .iter()
        .map(|(key, sub)| (key.as_str().into(), Types::of_schema(sub, 0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_types_from_schemas() {
        let schema = r#"{"type": "object", "properties": {
            "command": {"type": "string"},
            "timeout": {"type": "integer"},
            "ratio": {"type": "number"},
            "force": {"type": "boolean"},
            "maybe": {"type": ["string", "null"]},
            "any": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {}}]},
            "mode": {"enum": ["a", "b"]},
            "todos": {"items": {"type": "object"}},
            "opts": {"properties": {}},
            "free": {}
        }}"#;
        let tools = ToolSchemas::new(&[("Bash", schema), ("Bad", "{not json")]);
        let t = |key| tools.param("Bash", key);
        assert_eq!(t("command"), Types::STRING);
        assert_eq!(t("timeout"), Types::INTEGER);
        assert_eq!(t("ratio"), Types::NUMBER);
        assert_eq!(t("force"), Types::BOOLEAN);
        assert_eq!(t("maybe"), Types::STRING | Types::NULL);
        assert_eq!(t("any"), Types::INTEGER | Types::ARRAY);
        assert_eq!(t("mode"), Types::STRING);
        assert_eq!(t("todos"), Types::ARRAY);
        assert_eq!(t("opts"), Types::OBJECT);
        assert_eq!(t("free"), Types::UNKNOWN);
        assert_eq!(t("missing"), Types::UNKNOWN);
        assert_eq!(tools.param("Bad", "x"), Types::UNKNOWN);
        assert_eq!(tools.param("Nope", "x"), Types::UNKNOWN);
        assert_eq!(tools.len(), 2);
    }
}
